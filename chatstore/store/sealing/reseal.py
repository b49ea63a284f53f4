"""Background jobs over every stored value, resumable: data-key rotation, encrypt-existing and
the version-1 migration.

    data-keys         keys -> records -> each KV tier -> retire -> done
    encrypt-existing          records -> each KV tier           -> done
    migrate-v1                records -> reindex                -> done

`data-keys` (`chatstore admin rotate-data-keys`) gives every tenant a new data key in front of
its old ones (`keys`: a tenant whose sealing key is newer than the job is left alone, so a
resumed job adds none twice), re-seals every value sealed under an older data key of its
tenant (`reseal` of the records store and of each tier: a value changed meanwhile is left as
its writer sealed it; one that does not open is left as it is and counted in `unopened`), then
drops the old data keys (`retire`). Master-key rotation needs no job: it rewraps the data keys
only (Keyring.rewrap_all).

`encrypt-existing` (`chatstore admin encrypt-existing`) is the one way a value written in the
clear (encrypt_at_rest = false) becomes sealed: it seals clear values that are valid records or
chunks and touches nothing sealed. No read, re-seal or migration ever accepts a clear value.

`migrate-v1` (`chatstore admin migrate-v1`) re-seals the records sealed by version 1 (keys
derived from the old secret, legacy_v1.py) as version-2 values under their tenants' data keys:
each is opened with the legacy secret given to the server and the tenant's shred generation,
its JSON checked, and sealed again; one that does not open (a tenant shredded under version 1,
a changed byte, another secret) is left as it is and counted in `unopened`; version-2 and
clear values are not its business (never adopted). Then `reindex` builds the prefix index and
the session counts again, which could not list those records while they did not open. KV
chunks are not migrated: they are a cache, and recompute (a miss each, once).

After each batch the job writes its cursor to `<data_dir>/reseal.json` (atomically), so a job
cut short by a crash resumes where it stopped when the same job is started again.
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
from chatstore.store.sealing import legacy_v1
from chatstore.store.sealing.keyring import Keyring
from chatstore.store.sealing.legacy_v1 import LegacyOpener
from chatstore.store.session_kv import ChunkKey

log = logging.getLogger(__name__)

CURSOR_FILE = "reseal.json"
BATCH = 64
LOG_EVERY = 100  # batches between two progress lines in the log
JOBS = ("data-keys", "encrypt-existing", "migrate-v1")


@dataclass
class ResealProgress:
    job: str  # data-keys | encrypt-existing | migrate-v1
    phase: str = "keys"  # (idle: none yet) [keys ->] records -> ... -> done (module doc)
    cursor: str = ""  # the last tenant, name or chunk looked at in this phase
    resealed: int = 0  # values rewritten (under the newest data key, adopted, or migrated)
    unopened: int = 0  # values left as they were because they did not open
    new_keys: int = 0  # tenants given a new data key (data-keys)
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
    """One job at a time over a records store and KV tiers (those with `reseal`)."""

    def __init__(
        self,
        keyring: Keyring,
        records: Any,
        tiers: list[Any],
        data_dir: Path,
        on_batch: Callable[[], None] = lambda: None,
    ) -> None:
        self.keyring = keyring
        self.records = records
        self.tiers = [t for t in tiers if hasattr(t, "reseal")]
        self.path = data_dir / CURSOR_FILE
        self.on_batch = on_batch  # tests: a hook between batches (e.g. simulate a crash)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._order: list[str] = []  # the current phase's names, sorted (cursor order)
        self._order_of = ""
        self.progress = self._load()
        self._legacy: LegacyOpener | None = None  # migrate-v1's keys, while it runs

    def _load(self) -> ResealProgress:
        try:
            progress = ResealProgress(**json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):  # none, or another version's
            return ResealProgress(JOBS[0], phase="idle")
        progress.running = False
        return progress

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_private(self.path, json.dumps(asdict(self.progress)))

    def phases(self, job: str) -> list[str]:
        tiers = [t.name for t in self.tiers]
        if job == "data-keys":
            return ["keys", "records", *tiers, "retire", "done"]
        if job == "migrate-v1":  # KV chunks are a cache: recomputed, not migrated
            return ["records", "reindex", "done"]
        return ["records", *tiers, "done"]

    def start(self, job: str = "data-keys", legacy: LegacyOpener | None = None) -> ResealProgress:
        """Start `job` (or resume it from the saved cursor) unless one is running; the
        progress now (the running job's, whichever it is). migrate-v1 opens with `legacy`,
        by default the legacy secret of this process's environment (KeyringError when none
        was given: nothing starts)."""
        if job not in JOBS:
            raise ValueError(f"unknown job {job!r}: one of {JOBS}")
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self.progress
            if job == "migrate-v1":
                # Read at each start (a resumed job too): the generations as they are now.
                self._legacy = legacy or legacy_v1.opener_from_environment(
                    self.path.parent, getattr(self.records, "client", None)
                )
            p = self.progress
            if p.phase in ("idle", "done") or p.job != job:
                self.progress = ResealProgress(job, phase=self.phases(job)[0])
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
            phases = self.phases(p.job)
            batches = 0
            while not p.done and not self._stop.is_set():
                self._batch(p.phase)
                batches += 1
                if batches % LOG_EVERY == 0:
                    log.info(
                        "%s: %s: %d values re-sealed, %d left unopened (cursor saved in %s)",
                        p.job, p.phase, p.resealed, p.unopened, self.path,
                    )  # fmt: skip
                if p.cursor == "" and not p.done:  # the phase is over: the next one
                    log.info(
                        "%s: %s done (%d values re-sealed, %d left unopened so far)",
                        p.job, p.phase, p.resealed, p.unopened,
                    )  # fmt: skip
                    p.phase = phases[phases.index(p.phase) + 1]
                    p.total_chunks = sum(len(t.keys()) for t in self.tiers)
                self._save()
                self.on_batch()
            if p.done:
                p.finished_at = time.time()
                log.info("%s: %d values re-sealed, %d left unopened", p.job, p.resealed, p.unopened)
        except Exception as exc:  # kept for the next start, which resumes from the cursor
            log.exception("%s stopped", p.job)
            p.error = f"{type(exc).__name__}: {exc}"
        finally:
            p.running = False
            self._legacy = None  # the legacy secret is held no longer than the job
            self._save()

    def _batch(self, phase: str) -> None:
        if phase in ("keys", "retire"):
            self._tenants_batch(phase)
        elif phase == "records":
            self._records_batch()
        elif phase == "reindex":
            self.records.rebuild_indexes()
            self.progress.cursor = ""
        else:
            self._tier_batch(next(t for t in self.tiers if t.name == phase))

    def _next(self, phase: str, names: Callable[[], list[str]]) -> list[str]:
        """The next BATCH names after the cursor, listed and sorted once per phase."""
        if self._order_of != phase:
            self._order = sorted(names())
            self._order_of = phase
        at = bisect.bisect_right(self._order, self.progress.cursor)
        return self._order[at : at + BATCH]

    def _tenants_batch(self, phase: str) -> None:
        p = self.progress
        tenants = self._next(phase, self.keyring.store.tenants)
        for tenant in tenants:
            if phase == "keys":
                p.new_keys += self.keyring.add_data_key(tenant, older_than=p.started_at)
            else:
                self.keyring.retire_data_keys(tenant)
        p.cursor = tenants[-1] if tenants else ""

    def _records_batch(self) -> None:
        p = self.progress
        unopened = self.records.open_failures
        adopt = p.job == "encrypt-existing"
        legacy = None
        if p.job == "migrate-v1":
            legacy = self._legacy
            if legacy is None:  # never a rotation's re-seal in its place
                raise RuntimeError("migrate-v1 runs without the legacy secret: start it again")
        done, last = self.records.reseal_all(p.cursor.encode("latin-1"), BATCH, adopt, legacy)
        p.resealed += done
        p.unopened += self.records.open_failures - unopened
        p.cursor = last.decode("latin-1") if last is not None else ""

    def _tier_batch(self, tier: Any) -> None:
        """The next BATCH chunks after the cursor. Chunks stored since the phase began were
        sealed under the newest data key already."""
        p = self.progress
        # A shared tier knows only some of its keys (Redis: no SCAN at start); the job walks
        # all of them (stored_keys: a SCAN of the model's keys).
        stored = getattr(tier, "stored_keys", tier.keys)
        names = self._next(tier.name, lambda: [_chunk_cursor(k) for k in list(stored())])
        adopt = p.job == "encrypt-existing"
        for name in names:
            tenant, _, digest = name.partition("\x00")
            p.resealed += bool(tier.reseal(ChunkKey(tenant, digest), adopt))
            p.scanned_chunks += 1
        p.cursor = names[-1] if names else ""


def _chunk_cursor(key: ChunkKey) -> str:
    return f"{key.tenant}\x00{key.digest}"
