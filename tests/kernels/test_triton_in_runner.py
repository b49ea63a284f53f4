"""The runner on the Triton kernels (kv_layout.PagedAttention, runner.elementwise_ops).

On CUDA the runner takes them by default; here `ModelRunner(triton=True)` makes a CPU runner
take them too, interpreted, so the whole forward (TritonOps' norms, RoPE + pool write and
SiLU * up, Triton attention for prefill, decode and a mixed step in one launch a layer) is checked
against transformers at the runner's own tolerance (tests/engine/test_runner_exact.py: 1e-4).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.kv_layout import AttentionKernels
from chatstore.engine.runner import ModelRunner
from chatstore.model.spec import ModelSpec
from tests.support.tiny_models import tiny_hf_model

TOL = 1e-4
BLOCK = 16


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def triton_runner(arch: str) -> ModelRunner:
    model = tiny_hf_model(arch, seed=5)
    spec = ModelSpec.from_hf_config(model.config)
    runner = ModelRunner(model, spec, PagedKVCache(spec, 16, BLOCK, torch.float32), triton=True)
    assert runner.ops.name == "triton" and runner.mixed_batches_in_place
    return runner


def forward(runner: ModelRunner, chunks: list[SequenceChunk]) -> torch.Tensor:
    batch = ForwardBatch.build(chunks, BLOCK, all_logits=True)
    assert runner.layout.step_attention(batch, runner.kernels).triton is not None
    return runner.forward(batch)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_then_a_mixed_step_match_transformers(arch: str) -> None:
    runner = triton_runner(arch)
    model = tiny_hf_model(arch, seed=5)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(2, 256, (24,), generator=gen).tolist()  # 23 prompt tokens, 1 decoded
    b = torch.randint(2, 256, (21,), generator=gen).tolist()  # a turn of 5, then one of 16
    table_a, table_b = [3, 9], [12, 1]  # scattered blocks
    first = forward(runner, [SequenceChunk(a[:23], 0, table_a), SequenceChunk(b[:5], 0, table_b)])
    ref_a, ref_b = hf_logits(model, a), hf_logits(model, b)
    assert (first - torch.cat([ref_a[:23], ref_b[:5]])).abs().max().item() <= TOL
    # One decode beside a 16-token turn on pooled history: one forward, one launch a layer.
    mixed = forward(runner, [SequenceChunk(a[23:], 23, table_a), SequenceChunk(b[5:], 5, table_b)])
    assert (mixed - torch.cat([ref_a[23:], ref_b[5:]])).abs().max().item() <= TOL


def test_which_steps_take_triton() -> None:
    """The rule: Triton when asked for (True), never when refused (False) or on the reference
    path (fast = False); by default (None) only for a CUDA pool."""
    base = AttentionKernels(fast=True, native_prefill=True, scale=0.125, groups=3)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not base.use_triton(cpu)
    assert base.use_triton(cuda)  # Triton is installed here
    assert replace(base, triton=True).use_triton(cpu)
    assert not replace(base, triton=False).use_triton(cuda)
    assert not replace(base, fast=False, triton=True).use_triton(cpu)
    assert not replace(base, fast=False).use_triton(cuda)


def test_cpu_path_never_imports_triton() -> None:
    """The attention choice on a CPU pool loads no Triton; a runner built on a CPU pool keeps
    the CPU's ops and loads none of our Triton modules (building a transformers model imports
    Triton itself, so that is what the second half can check)."""
    code = (
        "import sys, torch\n"
        "from chatstore.engine.kv_layout import AttentionKernels\n"
        "import chatstore.engine.runner, chatstore.kernels.triton\n"
        "assert not AttentionKernels(True, True, 0.125, 3).use_triton(torch.device('cpu'))\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'triton'], 'triton imported'\n"
        "from chatstore.engine.kv_cache import PagedKVCache\n"
        "from chatstore.engine.runner import ModelRunner\n"
        "from chatstore.model.spec import ModelSpec\n"
        "from tests.support.tiny_models import tiny_hf_model\n"
        "m = tiny_hf_model('llama')\n"
        "spec = ModelSpec.from_hf_config(m.config)\n"
        "r = ModelRunner(m, spec, PagedKVCache(spec, 4, 16))\n"
        "assert r.ops.name in ('native', 'torch') and not r.triton_attention, r.ops\n"
        "ours = [m for m in sys.modules if m.startswith('chatstore.kernels.triton.')]\n"
        "assert not ours, ours\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
