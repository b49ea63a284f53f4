"""Usage and timings of a turn as the APIs report them; cached tokens split by their tier.

`cached_tokens_by_tier` is an extension field: OpenAI clients ignore it, dashboards and the
terminal client read it.
"""

from __future__ import annotations

from chatstore.api.chat.turn import TurnResult
from chatstore.engine.request import Usage

TIERS = ("device", "dram", "ssd", "remote")


def cached_by_tier(u: Usage) -> dict[str, int]:
    """Every tier named, zeros included, so clients can index without checks."""
    return {tier: int(u.cached_by_tier.get(tier, 0)) for tier in TIERS}


def usage_body(result: TurnResult) -> dict[str, object]:
    """The Chat Completions usage object."""
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "cached_tokens_by_tier": cached_by_tier(u),
    }


def timings(result: TurnResult) -> dict[str, float | None]:
    def ms(s: float | None) -> float | None:
        return None if s is None else round(s * 1000, 3)

    return {
        "ttft_ms": ms(result.ttft_s),
        "engine_ttft_ms": ms(result.engine_ttft_s),
        "total_ms": ms(result.total_s),
    }
