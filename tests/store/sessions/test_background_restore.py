"""The session index restored after start, on its own thread (issue 23: start-up that does not
grow with the sessions stored). The store serves at once; what it serves meanwhile must be what
a store restored before serving would serve:

- a session the restore has not reached is read from its record when asked (`ensure`);
- a chunk that loses its last *known* holder is not deleted while a session not restored yet
  may list it (the deletes wait for the restore's end);
- a session deleted meanwhile is not brought back by the restore;
- at the end, the index equals a synchronous restore's, and orphans are swept.

The restore thread is held between batches (a gate around its real `_index`) so that "during"
is a fixed state, not a race. Real LMDB records and tiers.
"""

from __future__ import annotations

import threading

import pytest
import torch

from chatstore.store.attention_store import AttentionStore
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.sessions import restore as restore_module
from chatstore.store.settings import StoreSettings
from tests.support.store import TINY_SPEC, lookup

SPEC = TINY_SPEC
CHUNK = 16
SHARED = [3 + (i % 50) for i in range(CHUNK)]  # one full chunk every session begins with
SESSIONS = 40
ALL = [SessionKey("t", f"s{i}") for i in range(SESSIONS)]


def value(sid: int) -> SessionKV:
    g = torch.Generator().manual_seed(sid)
    ids = SHARED + [100 + sid * 50 + i for i in range(CHUNK + 5)]
    kv = torch.randn((2, 2, len(ids), 2, 4), generator=g)
    kv[:, :, :CHUNK] = torch.randn((2, 2, CHUNK, 2, 4), generator=torch.Generator().manual_seed(0))
    return SessionKV(ids, kv)


def make(tmp_path, background: bool) -> AttentionStore:
    settings = StoreSettings(
        data_dir=tmp_path,
        dram_bytes=1 << 20,
        ssd_bytes=16 << 20,
        block_size=4,
        chunk_tokens=CHUNK,
        persist="write_through",
        background_restore=background,
    )
    return AttentionStore(settings, SPEC, "fp")


@pytest.fixture
def populated(tmp_path):
    store = make(tmp_path, background=False)
    for sid in range(SESSIONS):
        store.save("t", f"s{sid}", value(sid))
    store.close()
    return tmp_path


@pytest.fixture
def gated(monkeypatch):
    """The restore thread indexes its first batch, then waits for `gate` before each next."""
    gate, reached = threading.Event(), threading.Event()
    real = restore_module.IndexRestore._index
    batches = []

    def held(self, records):
        if batches and threading.current_thread().name == "chatstore-restore":
            reached.set()
            assert gate.wait(30), "the test never let the restore go on"
        batches.append(len(records))
        return real(self, records)

    monkeypatch.setattr(restore_module, "BATCH", 8)
    monkeypatch.setattr(restore_module.IndexRestore, "_index", held)
    return gate, reached


def _keys(store: AttentionStore) -> dict[SessionKey, list[ChunkKey]]:
    return {k: list(store.index.get(k).chunks) for k in store.index.sessions()}


def test_serves_while_restoring_as_a_restored_store_would(populated, gated):
    gate, reached = gated
    store = make(populated, background=True)
    try:
        assert reached.wait(30) and store.restore.restoring
        known = set(store.index.sessions())
        assert 0 < len(known) < SESSIONS  # the first batch only
        unrestored = [k for k in ALL if k not in known]
        late = unrestored[0]
        # A session the restore has not reached: found (read from its record), whole.
        whole = lookup(store, "t", late.session_id)
        assert whole is not None and whole.equal(value(int(late.session_id[1:])))
        # Every restored session but one sharing the first chunk is deleted: the chunk's
        # only known holder left is `late`'s... and the sessions not restored yet list it too.
        shared = store.index.get(late).chunks[0]
        for key in list(store.index.sessions()):
            if key != late:
                assert store.delete_session("t", key.session_id)
        gone = unrestored[1]
        assert store.delete_session("t", gone.session_id)  # not restored yet, deleted now
        assert store.delete_session("t", late.session_id)  # the last known holder of `shared`
        assert store.tiers.contains(shared)  # waits: unrestored sessions may list it
    finally:
        gate.set()
    assert store.restore.wait(30)
    try:
        assert gone not in store.index.sessions()  # not brought back
        left = [k for k in ALL if k not in known and k not in (late, gone)]
        assert set(store.index.sessions()) == set(left)
        for key in left:  # every session the restore brought in reads whole, `shared` first
            found = lookup(store, "t", key.session_id)
            assert found is not None and found.equal(value(int(key.session_id[1:])))
        # The deleted sessions' own chunks are gone once the restore ended (their deletes
        # waited); nothing any session lists is.
        listed = {c for k in left for c in store.index.get(k).chunks}
        stored = set(store.tier("ssd").keys())
        assert stored == listed
    finally:
        store.close()


def test_the_restored_index_equals_a_synchronous_restore(populated, tmp_path_factory):
    sync = make(populated, background=False)
    expected = _keys(sync)
    sync.close()
    store = make(populated, background=True)
    try:
        assert store.restore.wait(30)
        assert _keys(store) == expected and len(expected) == SESSIONS
        assert store.restore.restored == SESSIONS
    finally:
        store.close()
