"""Per-session retention: how long an idle session lives and how hard its KV holds on.

    priority   an integer in [PRIORITY_MIN, PRIORITY_MAX], default 0. Placement ranks sessions
               by priority first and by the policy's own order (LRU, FIFO, look-ahead) inside
               one priority: a tier that must make room moves every lower-priority session
               down before a higher one. Priority never lets a tier overfill: when only
               high-priority sessions are left, they go down too.
    ttl_s      idle seconds before the session (record and KV) expires; 0 = the server's
               `session_ttl_s`.

Both live in the session record (records.py), so they survive restarts and are shared by
replicas; the store keeps a copy per session (`RetentionTable`) for the placement policy and the
expiry checks that run without reading records (sessions/retention_table.py).
"""

from __future__ import annotations

from dataclasses import dataclass

PRIORITY_MIN = -10
PRIORITY_MAX = 10
TTL_MAX_S = 10 * 365 * 86400  # ten years: longer is a typo, not a retention policy


@dataclass(frozen=True)
class Retention:
    priority: int = 0
    ttl_s: int = 0  # 0: the server's session TTL

    def ttl(self, default_s: int) -> int:
        """The TTL in force (0: never expires)."""
        return self.ttl_s or default_s


DEFAULT = Retention()


class RetentionError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_retention(priority: int | None, ttl_s: int | None) -> None:
    """RetentionError naming the field when a value is out of range (None: not given)."""
    if priority is not None and not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise RetentionError(
            "priority", f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], not {priority}"
        )
    if ttl_s is not None and not 0 <= ttl_s <= TTL_MAX_S:
        raise RetentionError(
            "ttl_s", f"ttl_s must be in [0, {TTL_MAX_S}] (0: server default), not {ttl_s}"
        )
