"""The paged-prefill kernel against torch's SDPA, one layer of the default model's shape.

    causal   2,048 new tokens attending to themselves (a fresh prompt)
    history  100 new tokens on 1K / 2K / 4K / 8K tokens of history

Ours reads K and V from a paged pool (block 16, blocks in order) in place; SDPA gets them already
contiguous (the gather it would need from a paged pool is not counted) and, for history, the
causal offset mask. Median of repeated calls; the last line is one JSON object.

    python bench/attention_kernels.py [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from engine_speed import median_seconds

from chatstore.kernels.paged_attention import attend
from chatstore.kernels.paged_prefill import make_prefill_plan, paged_prefill_native

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def median_ms(fn: Callable[[], object], reps: int = 10) -> float:
    return 1e3 * median_seconds(fn, reps)


def case(new: int, context: int, dtype: torch.dtype) -> tuple[float, float]:
    """ms ours, ms SDPA for `new` tokens whose context is `context` tokens."""
    g = torch.Generator().manual_seed(context)
    blocks = (context + BLOCK - 1) // BLOCK
    q = torch.randn(new, HEADS, HEAD_DIM, generator=g).to(dtype)
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    plan = make_prefill_plan(torch.arange(blocks)[None], [new], [context])
    k, v = k_cache.flatten(0, 1)[:context], v_cache.flatten(0, 1)[:context]
    scale = HEAD_DIM**-0.5
    ours = median_ms(lambda: paged_prefill_native(q, k_cache, v_cache, plan, scale))
    sdpa = median_ms(lambda: attend(q, k, v, scale))
    return ours, sdpa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    print(f"attention_kernels: {args.dtype}, {torch.get_num_threads()} threads, one layer")
    print(f"{'case':<26}{'ours ms':>10}{'sdpa ms':>10}{'sdpa/ours':>11}")
    result: dict[str, object] = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    cases = [("causal_2k", 2048, 2048)] + [
        (f"history_{round(n / 1024)}k", 100, n + 100) for n in (1024, 2048, 4096, 8000)
    ]
    for name, new, context in cases:
        ours, sdpa = case(new, context, dtype)
        print(
            f"{name + f' ({new} on {context})':<26}{ours:>10.2f}{sdpa:>10.2f}{sdpa / ours:>10.2f}x"
        )
        result |= {f"{name}_ms_ours": round(ours, 3), f"{name}_ms_sdpa": round(sdpa, 3)}
        result[f"{name}_speedup"] = round(sdpa / ours, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
