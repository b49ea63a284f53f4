"""The saver's device path (host_copies.py) run on a CPU: each step's kept rows go through the
staging ring, in one copy per step when the ring holds the whole step, one per layer when it
holds a layer, and into memory of their own when it holds neither, and land in the arena. Every
way must store the same rows as the saver's CPU path (no host copies); the CUDA-only parts (the
side stream, pinned memory, events) are what a GPU adds, the bookkeeping is all here."""

from __future__ import annotations

import pytest
import torch

from chatstore.transfer.host_copies import HostCopies
from chatstore.transfer.layer_saver import LayerSaver
from chatstore.transfer.pinned_staging import ALIGN, StagingRing

L, H, D = 3, 2, 4
CPU = torch.device("cpu")
ROW = 2 * H * D * 4  # one token's K and V of one layer, fp32 bytes

# (request ids, query lens, context lens) of each step: a prefill of a and b (c is not tracked),
# decodes, a mixed step, decodes.
STEPS = [
    (["a", "c", "b"], [5, 3, 7], [5, 3, 7]),
    (["a", "b", "c"], [1, 1, 1], [6, 8, 4]),
    (["b", "a"], [1, 1], [9, 7]),
    (["c", "a", "b"], [1, 4, 1], [5, 11, 10]),
    (["a", "b"], [1, 1], [12, 11]),
]


def run(saver: LayerSaver) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The steps through the saver; each tracked request's stored rows and their mask."""
    gen = torch.Generator().manual_seed(7)
    for rid in ("a", "b"):
        saver.track(rid)
    for ids, query_lens, context_lens in STEPS:
        n = sum(query_lens)
        positions = torch.tensor(
            [p for q, c in zip(query_lens, context_lens, strict=True) for p in range(c - q, c)]
        )
        for layer in range(L):
            k, v = torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)
            saver.save_layer(layer, k, v, positions, ids, query_lens, context_lens)
    out = {}
    for rid in ("a", "b"):
        turn = saver.take(rid)
        kv = torch.zeros(L, 2, 16, H, D)
        mask = turn.scatter_into(kv, 0, 16)
        turn.release()
        out[rid] = (kv, mask)
    return out


def saver_with_ring(capacity: int) -> tuple[LayerSaver, HostCopies]:
    copies = HostCopies(CPU, torch.float32, L, StagingRing(capacity, pin=False))
    return LayerSaver(L, torch.float32, CPU, host_copies=copies), copies


@pytest.fixture(scope="module")
def direct() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return run(LayerSaver(L, torch.float32, CPU))


def same(got: dict, want: dict) -> bool:
    return all(
        torch.equal(got[r][0], want[r][0]) and torch.equal(got[r][1], want[r][1]) for r in want
    )


def test_a_ring_that_holds_a_step_makes_one_copy_per_step(direct) -> None:
    saver, copies = saver_with_ring(64 * ALIGN)
    assert same(run(saver), direct)
    assert copies.step_copies == len(STEPS) and copies.layer_copies == 0
    assert copies.unstaged_copies == 0 and copies.ring.in_use() == 0  # all landed, all free


def test_a_step_over_the_ring_goes_layer_by_layer(direct) -> None:
    # The prefill keeps 12 rows: L x 12 x ROW = 2,304 bytes for the step, 768 for a layer;
    # a layer's slot is free again once it landed, before the next layer's copy.
    saver, copies = saver_with_ring(4 * ALIGN)
    assert same(run(saver), direct)
    assert copies.layer_copies == L and copies.step_copies == len(STEPS) - 1
    assert copies.ring.in_use() == 0


def test_a_layer_over_the_ring_is_copied_into_memory_of_its_own(direct) -> None:
    # 256 bytes: a layer of a 2-row decode step (128), not its step (384); not a layer of the
    # prefill (12 rows: 768) nor of the mixed step (5 rows: 320).
    saver, copies = saver_with_ring(ALIGN)
    assert same(run(saver), direct)
    assert copies.unstaged_copies == 2 * L and copies.layer_copies == 3 * L
    assert copies.step_copies == 0 and copies.ring.in_use() == 0


def test_a_step_that_never_reached_its_last_layer_gives_its_slot_back(direct) -> None:
    """A forward that failed half-way leaves a step buffer behind: the next step frees it."""
    saver, copies = saver_with_ring(64 * ALIGN)
    saver.track("a")
    k = torch.randn(2, H, D)
    saver.save_layer(0, k, k, torch.tensor([0, 1]), ["a"], [2], [2])  # layer 0 only
    assert copies.ring.in_use() == 1
    saver.save_layer(0, k[:1], k[:1], torch.tensor([2]), ["a"], [1], [3])
    for layer in range(1, L):
        saver.save_layer(layer, k[:1], k[:1], torch.tensor([2]), ["a"], [1], [3])
    saver.take("a").release()
    copies.land(wait=True)
    assert copies.ring.in_use() == 0
