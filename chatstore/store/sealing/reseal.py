"""Key rotation: re-seal every stored value under the newest key, in the background, resumably.

The job walks the session records (and stored Responses), then the KV chunks of each slow tier
(LMDB, Redis), in a fixed order, and re-seals every value that is under an older key or in the
clear (`reseal` of the records store and of each tier: a value changed meanwhile is left as its
writer sealed it). After each batch it writes its cursor to `<data_dir>/reseal.json`
(atomically), so a job cut short by a crash resumes where it stopped when started again with
the same sealing key; with a newer sealing key it starts over.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chatstore.private_file import write_private
from chatstore.store.chunks import ChunkKey

log = logging.getLogger(__name__)

CURSOR_FILE = "reseal.json"
BATCH = 64


@dataclass
class ResealProgress:
    sealing_id: str
    phase: str = "records"  # (idle: none yet) records -> each KV tier by name -> done
    cursor: str = ""  # the last name or chunk looked at in this phase
    resealed: int = 0  # values rewritten under the sealing key
    scanned_chunks: int = 0  # chunks looked at in the KV phases
    total_chunks: int = 0  # chunks the KV tiers held when the job started its KV phases
    running: bool = False
    error: str = ""
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.phase == "done"


class Resealer:
    """One re-seal job at a time over a records store and KV tiers (those with `reseal`)."""

    def __init__(
        self,
        sealing_id: str,
        records: Any,
        tiers: list[Any],
        data_dir: Path,
        on_batch: Callable[[], None] = lambda: None,
    ) -> None:
        self.sealing_id = sealing_id
        self.records = records
        self.tiers = [t for t in tiers if hasattr(t, "reseal")]
        self.path = data_dir / CURSOR_FILE
        self.on_batch = on_batch  # tests: a hook between batches (e.g. simulate a crash)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._order: list[str] = []  # the current KV phase's chunks, sorted (cursor order)
        self._order_of = ""
        self.progress = self._load()

    def _load(self) -> ResealProgress:
        try:
            saved = json.loads(self.path.read_text())
            progress = ResealProgress(**saved)
        except (OSError, ValueError, TypeError):
            return ResealProgress(self.sealing_id, phase="idle")
        progress.running = False
        if progress.sealing_id != self.sealing_id:  # a newer key: everything again
            return ResealProgress(self.sealing_id, phase="idle")
        return progress

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_private(self.path, json.dumps(asdict(self.progress)))

    def start(self) -> ResealProgress:
        """Start (or resume from the saved cursor) unless running; the progress now."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self.progress
            if self.progress.phase in ("idle", "done"):
                self.progress = ResealProgress(self.sealing_id)
            self.progress.running = True
            self.progress.error = ""
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="chatstore-reseal", daemon=True)
            self._thread.start()
            return self.progress

    def wait(self, timeout: float | None = None) -> bool:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self.wait(10.0)

    def _run(self) -> None:
        p = self.progress
        try:
            phases = ["records", *(t.name for t in self.tiers), "done"]
            while not p.done and not self._stop.is_set():
                if p.phase == "records":
                    self._records_batch()
                else:
                    self._tier_batch(next(t for t in self.tiers if t.name == p.phase))
                if p.cursor == "" and not p.done:  # the phase is over: the next one
                    p.phase = phases[phases.index(p.phase) + 1]
                    p.total_chunks = sum(len(t.keys()) for t in self.tiers)
                self._save()
                self.on_batch()
            if p.done:
                p.finished_at = time.time()
                log.info("key rotation: %d values re-sealed under %r", p.resealed, p.sealing_id)
        except Exception as exc:  # kept for the next start, which resumes from the cursor
            log.exception("key rotation stopped")
            p.error = f"{type(exc).__name__}: {exc}"
        finally:
            p.running = False
            self._save()

    def _records_batch(self) -> None:
        p = self.progress
        done, last = self.records.reseal_all(p.cursor.encode("latin-1"), BATCH)
        p.resealed += done
        p.cursor = last.decode("latin-1") if last is not None else ""

    def _tier_batch(self, tier: Any) -> None:
        """The next BATCH chunks after the cursor. The tier's keys are sorted once per phase
        (not per batch); chunks stored since were written under the sealing key already."""
        p = self.progress
        if self._order_of != tier.name:
            # A shared tier knows only some of its keys (Redis: no SCAN at start); the
            # rotation walks all of them (stored_keys: a SCAN of the model's keys).
            stored = getattr(tier, "stored_keys", tier.keys)
            self._order = sorted(_chunk_cursor(k) for k in list(stored()))
            self._order_of = tier.name
        at = bisect.bisect_right(self._order, p.cursor)
        names = self._order[at : at + BATCH]
        for name in names:
            tenant, _, digest = name.partition("\x00")
            p.resealed += bool(tier.reseal(ChunkKey(tenant, digest)))
            p.scanned_chunks += 1
        p.cursor = names[-1] if names else ""


def _chunk_cursor(key: Any) -> str:
    return f"{key.tenant}\x00{key.digest}"
