"""Position-decoupled KV: rotation at load is exact, and the truncation plan keeps the system
prompt, drops the oldest history, and cuts tokens and KV the same way."""

from __future__ import annotations

import pytest
import torch

from chatstore.engine.rope import RotaryEmbedding, apply_rope
from chatstore.model.weights import rope_from_hf_config
from chatstore.store.session_kv import SessionKV
from chatstore.store.sessions.truncation import (
    ContextOverflowError,
    TruncationPlan,
    plan_truncation,
)
from chatstore.transfer.rerope import rope_at, unrope
from tests.support.tiny_models import tiny_hf_model


@pytest.fixture(scope="module")
def rope():
    model = tiny_hf_model("llama")
    return RotaryEmbedding(rope_from_hf_config(model.config), 16, torch.device("cpu"))


def test_rope_at_is_the_runners_rotation(rope):
    k = torch.randn(7, 2, 16)
    pos = torch.arange(3, 10)
    cos, sin = rope.cos_sin(pos, torch.float32)
    assert torch.equal(rope_at(k, pos, rope, torch.float32), apply_rope(k, cos, sin))


def test_unrope_inverts_rope(rope):
    k = torch.randn(50, 2, 16)
    pos = torch.arange(1000, 1050)
    back = unrope(rope_at(k, pos, rope, torch.float32), pos, rope)
    torch.testing.assert_close(back, k, rtol=1e-5, atol=1e-5)


def test_rotation_depends_only_on_relative_position(rope):
    # q·k after rotation at (p + s, p' + s) equals that at (p, p'): why moved KV stays valid.
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    dots = []
    for shift in (0, 37, 500):
        qp = rope_at(q, torch.tensor([20 + shift]), rope, torch.float32)
        kp = rope_at(k, torch.tensor([5 + shift]), rope, torch.float32)
        dots.append(float((qp * kp).sum()))
    assert dots == pytest.approx([dots[0]] * 3, rel=1e-5)


def test_no_plan_when_it_fits():
    assert plan_truncation(100, head=10, tail=5, max_context=100, ratio=0.5) is None


def test_plan_drops_ratio_of_window_after_the_head():
    plan = plan_truncation(110, head=10, tail=20, max_context=100, ratio=0.5)
    assert plan == TruncationPlan(head=10, drop=50)


def test_plan_drops_at_least_the_overflow_and_at_most_the_history():
    assert plan_truncation(180, 10, 20, 100, 0.1).drop == 80  # overflow beats ratio
    assert plan_truncation(130, 10, 50, 100, 0.9).drop == 70  # all droppable history
    with pytest.raises(ContextOverflowError):
        plan_truncation(200, 10, 150, 100, 0.5)


def test_plan_cuts_ids_and_kv_alike():
    plan = TruncationPlan(head=2, drop=3)
    ids = list(range(10))
    assert plan.apply_ids(ids) == [0, 1, 5, 6, 7, 8, 9]
    kv = torch.arange(10.0).view(1, 1, 10, 1, 1).expand(2, 2, 10, 1, 1).contiguous()
    cut = plan.apply_kv(SessionKV(ids[:8], kv[:, :, :8]))
    assert cut.token_ids == [0, 1, 5, 6, 7]
    assert cut.kv[0, 0, :, 0, 0].tolist() == [0, 1, 5, 6, 7]
    short = plan.apply_kv(SessionKV(ids[:4], kv[:, :, :4]))  # KV ends inside the cut
    assert short.token_ids == [0, 1]
