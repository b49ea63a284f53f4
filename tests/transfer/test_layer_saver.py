"""LayerSaver: each request holds only its own rows (row arena), one copy per layer per step."""

from __future__ import annotations

import gc
import queue
import random
import threading
import weakref

import pytest
import torch

from chatstore.transfer import layer_saver as ls
from chatstore.transfer.layer_saver import PAGE_ROWS, LayerSaver, TurnRows
from chatstore.transfer.row_pages import Segment

LAYERS, HKV, D = 3, 3, 8

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


class Feeder:
    """Runs forwards through a LayerSaver with random K, V and keeps the reference rows:
    ref[rid][position] = [L, 2, Hkv, D] (float32), the last row computed for that position."""

    def __init__(self, saver: LayerSaver, device: str = "cpu", seed: int = 0) -> None:
        self.saver = saver
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)
        self.ref: dict[str, dict[int, torch.Tensor]] = {}

    def step(self, batch: list[tuple[str, list[int]]]) -> None:
        ids = [rid for rid, _ in batch]
        lens = [len(p) for _, p in batch]
        positions = torch.tensor([p for _, ps in batch for p in ps], dtype=torch.long)
        total = len(positions)
        layers = []
        for layer in range(LAYERS):
            # K, V as views of a fused qkv, like the runner's.
            qkv = torch.randn(total, 4 * HKV * D, generator=self.gen)
            k = qkv[:, HKV * D : 2 * HKV * D].view(-1, HKV, D)
            v = qkv[:, 2 * HKV * D : 3 * HKV * D].view(-1, HKV, D)
            layers.append(torch.stack((k, v), 1))
            dev = self.device
            self.saver.save_layer(layer, k.to(dev), v.to(dev), positions.to(dev), ids, lens)
        both = torch.stack(layers)  # [L, T, 2, Hkv, D]
        row = 0
        for rid, ps in batch:
            for i, p in enumerate(ps):
                self.ref.setdefault(rid, {})[p] = both[:, row + i].clone()
            row += len(ps)

    def expected(self, rid: str, start: int, end: int, dtype: torch.dtype) -> tuple:
        kv = torch.zeros((LAYERS, 2, end - start, HKV, D))
        mask = torch.zeros(end - start, dtype=torch.bool)
        for p, rows in self.ref.get(rid, {}).items():
            if start <= p < end:
                kv[:, :, p - start] = rows.to(dtype).float()
                mask[p - start] = True
        return kv, mask


def check_turn(feeder: Feeder, turn: TurnRows, rid: str, dtype: torch.dtype, ranges) -> None:
    for start, end in ranges:
        kv = torch.zeros((LAYERS, 2, end - start, HKV, D))
        mask = turn.scatter_into(kv, start, end)
        want_kv, want_mask = feeder.expected(rid, start, end, dtype)
        assert torch.equal(mask, want_mask), (rid, start, end)
        assert torch.equal(kv, want_kv), (rid, start, end)


def page_bytes(dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return PAGE_ROWS * (LAYERS * 2 * HKV * D * itemsize + 8)


def pages_for(rows: int) -> int:
    return -(-rows // PAGE_ROWS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_scatter_back_exactly(device: str, dtype: torch.dtype) -> None:
    rng = random.Random(1)
    saver = LayerSaver(LAYERS, dtype, torch.device(device))
    feeder = Feeder(saver, device)
    tracked = ["a", "b", "c", "d"]
    for rid in tracked[:3]:
        saver.track(rid)
    # Positions not starting at 0 (a turn after a saved prefix); "u" is never tracked.
    nxt = {rid: rng.randrange(0, 700) for rid in [*tracked, "u"]}
    kept_rows = 0
    for step in range(40):
        if step == 5:
            saver.track("d")  # from now on only
        batch = []
        for rid in rng.sample(list(nxt), k=rng.randrange(2, 6)):
            prefill = step < 8 and rng.random() < 0.6
            n = rng.randrange(20, 300) if prefill else 1
            batch.append((rid, list(range(nxt[rid], nxt[rid] + n))))
            nxt[rid] += n
        if step == 20:  # recomputed positions: the later row wins
            batch.append(("b", list(range(nxt["b"] - 3, nxt["b"]))))
        feeder.step(batch)
        if step < 5:
            feeder.ref.pop("d", None)  # d's rows before track() are not kept
        kept_rows += sum(len(ps) for rid, ps in batch if rid != "u" and (rid != "d" or step >= 5))
    feeder.ref.pop("u", None)
    assert saver.rows_saved == kept_rows
    assert len(saver._segments) > 1, "the test should span several arena segments"
    for rid in tracked:
        turn = saver.take(rid)
        ref_pos = sorted(feeder.ref[rid])
        assert turn.max_position() == ref_pos[-1]
        assert set(turn.positions().tolist()) == set(ref_pos)
        lo, hi = ref_pos[0], ref_pos[-1] + 1
        mid = (lo + hi) // 2
        ranges = [(0, hi), (lo, hi), (lo + 1, mid), (mid, hi + 5), (hi, hi + 3), (0, lo)]
        check_turn(feeder, turn, rid, dtype, ranges)
        turn.release()
        turn.release()  # idempotent
        with pytest.raises(RuntimeError):
            turn.scatter_into(torch.zeros((LAYERS, 2, 1, HKV, D)), 0, 1)
    assert saver.take("u").num_rows() == 0
    assert saver.held_bytes() == 0
    # Everything given back: the arena shrinks to its first segment.
    assert len(saver._segments) == 1


def test_positions_in_computed_order_and_counts() -> None:
    saver = LayerSaver(LAYERS, torch.float32, torch.device("cpu"))
    feeder = Feeder(saver)
    saver.track("a")
    feeder.step([("x", [0, 1]), ("a", [10, 11, 12])])
    feeder.step([("a", [13]), ("x", [2])])
    feeder.step([("a", [11])])  # recomputed
    feeder.step([("x", [3])])  # nothing tracked in this forward
    feeder.step([("a", [30, 31])])  # a gap: positions written are not contiguous
    assert saver.rows_saved == 7
    turn = saver.take("a")
    assert turn.positions().tolist() == [10, 11, 12, 13, 11, 30, 31]
    assert turn.num_rows() == 7
    assert turn.max_position() == 31
    assert turn.nbytes() == page_bytes(torch.float32)
    check_turn(feeder, turn, "a", torch.float32, [(10, 14), (0, 40), (11, 12), (12, 31)])
    turn.release()


def test_empty_turn_rows() -> None:
    saver = LayerSaver(LAYERS, torch.float32, torch.device("cpu"))
    for turn in (saver.take("never"), TurnRows()):
        assert turn.positions().shape == (0,)
        assert turn.max_position() == -1
        assert turn.num_rows() == 0
        assert turn.nbytes() == 0
        kv = torch.full((LAYERS, 2, 4, HKV, D), 7.0)
        mask = turn.scatter_into(kv, 3, 7)
        assert mask.shape == (4,) and not mask.any()
        assert (kv == 7).all()
        turn.release()
        turn.release()
    saver.track("t")  # tracked but never in a forward
    turn = saver.take("t")
    assert turn.num_rows() == 0 and not turn.scatter_into(kv, 0, 4).any()
    turn.release()
    assert saver.held_bytes() == 0 and saver.arena_bytes() == 0


def test_long_request_does_not_pin_finished_ones() -> None:
    """The defect: 32 requests decode together while one long one keeps running; the others
    come and go. What is held is the live requests' own rows, not their neighbours'."""
    rng = random.Random(2)
    dtype = torch.float32
    saver = LayerSaver(LAYERS, dtype, torch.device("cpu"))
    feeder = Feeder(saver, seed=2)
    pb = page_bytes(dtype)
    live: dict[str, list[int]] = {}  # rid -> [next position, steps left]
    counter = 0
    finished: list[weakref.ref] = []
    rows_total = 0
    peak_held = 0

    def start(rid: str, steps: int, prefill: int) -> None:
        saver.track(rid)
        live[rid] = [0, steps, prefill]

    start("long", 10**9, 40)
    for _ in range(31):
        counter += 1
        start(f"r{counter}", rng.randrange(5, 40), rng.randrange(1, 50))
    for _ in range(200):
        batch = []
        for rid, state in live.items():
            n = state[2] if state[0] == 0 else 1
            batch.append((rid, list(range(state[0], state[0] + n))))
            state[0] += n
            state[1] -= 1
            rows_total += n
        feeder.step(batch)
        for rid in [r for r, s in live.items() if s[1] <= 0]:
            turn = saver.take(rid)
            finished.append(weakref.ref(turn._rows))
            del live[rid]
            feeder.ref.pop(rid)
            turn.release()
            del turn
            counter += 1
            start(f"r{counter}", rng.randrange(5, 40), rng.randrange(1, 50))
        own = sum(pages_for(s[0]) for s in live.values()) * pb
        held = saver.held_bytes()
        assert held == own  # the live requests' own rows, rounded up to pages
        peak_held = max(peak_held, held)
    assert counter > 150  # requests came and went
    long_rows = live["long"][0]
    assert long_rows == 40 + 199
    # Freed pages are reused: the arena is far smaller than everything ever stored and at most
    # twice the peak of what was held at once (it doubles only when full).
    assert rows_total * pb / PAGE_ROWS > 5 * saver.arena_bytes()
    assert saver.arena_bytes() <= max(2 * peak_held, ls.FIRST_SEGMENT_PAGES * pb)

    # Nothing else holds finished requests' rows: their page lists are gone, and no tensor of
    # K, V rows lives outside the arena's segments.
    gc.collect()
    assert all(ref() is None for ref in finished)
    known = {s.kv.untyped_storage().data_ptr() for s in saver._segments}
    known |= {t.untyped_storage().data_ptr() for rows in feeder.ref.values() for t in rows.values()}
    stray = [
        t
        for t in gc.get_objects()
        if type(t) is torch.Tensor
        and t.shape[-3:] == (2, HKV, D)
        and t.untyped_storage().data_ptr() not in known
    ]
    assert stray == []

    turn = saver.take("long")
    assert turn.num_rows() == long_rows
    assert turn.nbytes() == pages_for(long_rows) * pb
    check_turn(feeder, turn, "long", dtype, [(0, long_rows), (100, 150)])
    turn.release()


@pytest.mark.parametrize("device", DEVICES)
def test_drop_frees_and_taken_rows_survive_page_reuse(device: str) -> None:
    dtype = torch.bfloat16
    saver = LayerSaver(LAYERS, dtype, torch.device(device))
    feeder = Feeder(saver, device, seed=3)
    pb = page_bytes(dtype)
    for rid in ("a", "b"):
        saver.track(rid)
    feeder.step([("a", list(range(5, 45))), ("b", list(range(70)))])
    for i in range(10):
        feeder.step([("b", [70 + i]), ("a", [45 + i])])
    assert saver.held_bytes() == (pages_for(50) + pages_for(80)) * pb

    turn_a = saver.take("a")  # taken, not released
    pages_a = set(turn_a._rows.pages)
    pages_b = set(saver._tracked["b"].pages)
    saver.drop("b")
    assert saver.held_bytes() == pages_for(50) * pb  # b freed at once
    del feeder.ref["b"]

    saver.track("c")
    feeder.step([("c", list(range(100)))])
    for i in range(40):
        feeder.step([("c", [100 + i])])
    pages_c = set(saver._tracked["c"].pages)
    assert pages_c & pages_b  # b's pages were reused...
    assert not pages_c & pages_a  # ...a's were not: a is taken, not released
    check_turn(feeder, turn_a, "a", dtype, [(0, 60), (5, 55), (20, 30)])

    turn_a.release()
    assert saver.held_bytes() == pages_for(140) * pb
    saver.track("d")
    feeder.step([("d", list(range(40)))])
    assert set(saver._tracked["d"].pages) & pages_a  # now a's pages are reused
    turn_c = saver.take("c")
    check_turn(feeder, turn_c, "c", dtype, [(0, 140)])
    turn_c.release()
    saver.drop("d")
    saver.drop("d")
    assert saver.held_bytes() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_writer_thread_reads_while_engine_runs(device: str) -> None:
    """Engine thread steps and takes; a writer thread scatters and releases concurrently."""
    rng = random.Random(4)
    saver = LayerSaver(LAYERS, torch.float32, torch.device(device))
    feeder = Feeder(saver, device, seed=4)
    todo: queue.Queue = queue.Queue()
    errors: list[str] = []

    def writer() -> None:
        while (item := todo.get()) is not None:
            rid, turn, want = item
            n = max(want) + 1
            kv = torch.zeros((LAYERS, 2, n, HKV, D))
            mask = turn.scatter_into(kv, 0, n)
            ok = bool(mask.all()) and all(torch.equal(kv[:, :, p], r) for p, r in want.items())
            if not ok:
                errors.append(rid)
            turn.release()

    thread = threading.Thread(target=writer)
    thread.start()
    live: dict[str, int] = {}
    for i in range(8):
        saver.track(f"q{i}")
        live[f"q{i}"] = 0
    counter = 8
    for _ in range(150):
        batch = []
        for rid, pos in live.items():
            n = rng.randrange(1, 20) if pos == 0 else 1
            batch.append((rid, list(range(pos, pos + n))))
            live[rid] = pos + n
        feeder.step(batch)
        for rid in [r for r in live if rng.random() < 0.1]:
            todo.put((rid, saver.take(rid), feeder.ref.pop(rid)))
            del live[rid]
            counter += 1
            saver.track(f"q{counter}")
            live[f"q{counter}"] = 0
    todo.put(None)
    thread.join()
    assert errors == []
    assert counter > 40
    for rid in list(live):
        saver.drop(rid)
    assert saver.held_bytes() == 0


def test_an_arena_made_during_a_forward_takes_rows_outside_it():
    # The engine's forward runs in inference mode and grows the arena there; on CUDA the rows
    # land later on the writer thread, outside it (host_copies.py): the arena must take them.
    with torch.inference_mode():
        segment = Segment(0, 1, LAYERS, (1, 2), torch.float32)
    rows = torch.ones(3, 2, 1, 2)
    segment.kv[0].index_copy_(0, torch.tensor([0, 1, 2]), rows)
    segment.positions.index_copy_(0, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7]))
    assert torch.equal(segment.kv[0, :3], rows) and segment.positions[:3].tolist() == [5, 6, 7]
