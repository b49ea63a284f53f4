"""A ballast file beside the records' LMDB environment, so that a full disk can still delete.

A delete is how room is made on a full disk, yet it writes too (copy-on-write pages for the
record, its log, the tenant's count and the expiry and start-up indexes), and an append-only
log leaves few free pages to reuse. So the store keeps a ballast file beside the environment:
a delete that finds the disk full removes it (room at once, no LMDB page needed) and tries
again; the ballast comes back once the disk has room.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

BALLAST = "ballast"
BALLAST_BYTES = 1 << 20


def keep(path: Path) -> None:
    """Put the ballast back when the disk has room for it and twice as much to spare."""
    from chatstore.store.tiers.lmdb import free_bytes

    ballast = path / BALLAST
    if ballast.exists():
        return
    free = free_bytes(path)
    if free is None or free < 3 * BALLAST_BYTES:
        return
    try:
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(BALLAST_BYTES))  # written, not sparse: it must hold the room
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        ballast.unlink(missing_ok=True)


def drop(path: Path) -> bool:
    """Release the ballast (a delete found the disk full); False when there is none."""
    ballast = path / BALLAST
    if not ballast.exists():
        return False
    ballast.unlink()
    log.warning("session records: disk full, ballast (%d bytes) released", BALLAST_BYTES)
    return True
