"""Asynchronous save with a write buffer (CachedAttention §3.2.2): the engine thread hands the
finished turn over and returns; readers see only complete turns; a crash mid-write leaves the
previous or the new turn, never a mixture."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from chatstore.store.attention_store import AttentionStore
from chatstore.store.commit.write_buffer import WriteBuffer
from chatstore.store.session_kv import SessionKey
from chatstore.store.settings import StoreSettings
from tests.support.store import (
    TINY_SPEC,
    TOKEN_BYTES,
    lookup,
    save_later,
    saved_tokens,
    three_turns,
    value,
)

ROOT = Path(__file__).resolve().parents[3]


def make(tmp_path, **kw) -> AttentionStore:
    kw.setdefault("dram_bytes", 64 * 16 * TOKEN_BYTES)
    kw.setdefault("ssd_bytes", 1 << 24)
    kw.setdefault("async_save", True)
    return AttentionStore(StoreSettings(data_dir=tmp_path, **kw), TINY_SPEC, "fp")


def test_save_later_returns_before_the_write_and_lookup_waits(tmp_path):
    store = make(tmp_path)
    old, new = value(16, 1), value(24, 2)
    store.save("t", "s", old)
    gate = threading.Event()
    save_later(store, "t", "s", new, gate)  # returns with the write held by the gate
    assert store.writer.is_pending(SessionKey("t", "s"))
    threading.Timer(0.2, gate.set).start()
    got = lookup(store, "t", "s")  # waits for the pending turn: never the half-written one
    assert got is not None and got.equal(new)
    assert saved_tokens(store, "t", "s") == new.token_ids
    store.close()


def test_sync_mode_writes_in_the_caller(tmp_path):
    store = make(tmp_path, async_save=False)
    v = value(16, 3)
    save_later(store, "t", "s", v)
    assert not store.writer.is_pending(SessionKey("t", "s"))
    assert store.tier_of("t", "s") == "dram"
    store.close()


def test_turns_of_one_session_land_in_order_and_delete_waits(tmp_path):
    store = make(tmp_path)
    values = [value(16 + i, i) for i in range(5)]
    for v in values:
        save_later(store, "t", "s", v)
    assert lookup(store, "t", "s").equal(values[-1])
    save_later(store, "t", "s", values[0])
    assert store.delete_session("t", "s")
    assert lookup(store, "t", "s") is None  # the pending write did not resurrect it
    store.close()


def test_write_buffer_back_pressure():
    committed: list[str] = []
    buffer = WriteBuffer(lambda key, v: committed.append(key), capacity_bytes=100)
    gate = threading.Event()

    def blocked():
        gate.wait(10)
        return None

    buffer.submit("a", blocked, 80)  # buffer: 80 of 100 bytes
    done = threading.Event()

    def second() -> None:
        buffer.submit("b", lambda: None, 50)  # 130 > 100: waits for "a"
        done.set()

    threading.Thread(target=second).start()
    assert not done.wait(0.2)
    gate.set()
    assert done.wait(5)
    assert buffer.flush(5)
    assert committed == ["a", "b"] and buffer.stalls == 1
    buffer.submit("huge", lambda: None, 10_000)  # larger than the buffer: accepted when empty
    assert buffer.flush(5)
    buffer.close()


def test_a_failed_write_is_logged_and_not_pending():
    def commit(key, v):
        raise OSError("disk full")

    buffer = WriteBuffer(commit)
    buffer.submit("a", lambda: None, 1)
    assert buffer.flush(5)
    assert buffer.failures == 1 and not buffer.is_pending("a")
    buffer.close()


def test_close_commits_pending_writes(tmp_path):
    store = make(tmp_path)
    v = value(16, 4)
    save_later(store, "t", "s", v)
    store.close()
    again = make(tmp_path)
    assert lookup(again, "t", "s").equal(v)
    again.close()


# The child writes three_turns()'s first turn, then its second and third over and over.
CHILD = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from chatstore.store.attention_store import AttentionStore
    from chatstore.store.settings import StoreSettings
    from tests.support.store import TINY_SPEC, save_later, three_turns

    settings = StoreSettings(data_dir=Path(sys.argv[1]), dram_bytes=0, ssd_bytes=1 << 28,
                             async_save=True)
    store = AttentionStore(settings, TINY_SPEC, "fp")
    vs = three_turns()
    store.save("t", "s", vs[0])
    print("ready", flush=True)
    i = 0
    while True:
        i += 1
        v = vs[1 + i % 2]
        save_later(store, "t", "s", v)
        store.writer.flush()
    """
)


@pytest.mark.parametrize("delay_s", [0.02, 0.05, 0.09, 0.13, 0.21, 0.31])
def test_kill_during_async_save_leaves_a_complete_turn(tmp_path, delay_s):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "ready", child.stderr.read() if child.stderr else line
        time.sleep(delay_s)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    store = AttentionStore(
        StoreSettings(data_dir=tmp_path, dram_bytes=0, ssd_bytes=1 << 28), TINY_SPEC, "fp"
    )
    got = lookup(store, "t", "s")
    assert got is not None
    assert any(got.equal(v) for v in three_turns()), f"torn KV: {got.num_tokens} tokens"
    chain = store.index.get(SessionKey("t", "s"))
    assert set(store.tier("ssd").keys()) == set(chain.chunks), "an orphan chunk survived"
    store.close(flush_dram=False)


def test_writer_uses_one_torch_thread_and_leaves_the_process_setting():
    import torch

    before = torch.get_num_threads()
    seen: list[int] = []
    buffer = WriteBuffer(lambda key, v: seen.append(torch.get_num_threads()))
    buffer.submit("a", lambda: None, 1)
    assert buffer.flush(5)
    buffer.close()
    assert seen == [1]
    assert torch.get_num_threads() == before
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [before]
