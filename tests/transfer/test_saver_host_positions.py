"""The saver takes a step's positions from the host lists when the positions tensor sits on a
device (ForwardBatch.context_lens, query_lens), so a CUDA step costs it no device-to-host copy
and no sync. Checked on a CPU with the positions on the `meta` device, which holds no values:
reading them would raise, so the rows' positions can only have come from the lists."""

from __future__ import annotations

import pytest
import torch

from chatstore.transfer.layer_saver import LayerSaver, host_positions

LAYERS, HKV, D = 2, 3, 8


def test_host_positions_from_the_lists() -> None:
    meta = torch.empty(7, dtype=torch.long, device="meta")
    got = host_positions(meta, [1, 4, 2], [10, 4, 7])
    assert got.device.type == "cpu" and got.tolist() == [9, 0, 1, 2, 3, 5, 6]
    on_cpu = torch.tensor([3, 4])
    assert host_positions(on_cpu, [2], [99]) is on_cpu  # a CPU step: the tensor as it is


def test_a_step_with_device_positions_saves_rows_at_the_listed_positions() -> None:
    saver = LayerSaver(LAYERS, torch.float32, torch.device("cpu"))
    for rid in ("a", "b"):
        saver.track(rid)
    query_lens, context_lens = [3, 1], [3, 8]  # a: a prompt of 3; b: a decode at position 7
    positions = torch.empty(4, dtype=torch.long, device="meta")
    k = torch.randn(LAYERS, 4, HKV, D)
    v = torch.randn(LAYERS, 4, HKV, D)
    for layer in range(LAYERS):
        saver.save_layer(layer, k[layer], v[layer], positions, ["a", "b"], query_lens, context_lens)
    for rid, rows, want in (("a", slice(0, 3), [0, 1, 2]), ("b", slice(3, 4), [7])):
        turn = saver.take(rid)
        kv = torch.zeros((LAYERS, 2, 8, HKV, D))
        mask = turn.scatter_into(kv, 0, 8)
        assert mask.nonzero().flatten().tolist() == want
        assert torch.equal(kv[:, 0, want], k[:, rows]) and torch.equal(kv[:, 1, want], v[:, rows])
        turn.release()


def test_without_the_lists_device_positions_are_read() -> None:
    saver = LayerSaver(LAYERS, torch.float32, torch.device("cpu"))
    saver.track("a")
    meta = torch.empty(1, dtype=torch.long, device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        saver.save_layer(0, torch.randn(1, HKV, D), torch.randn(1, HKV, D), meta, ["a"], [1])
