"""The attention kernels against torch's SDPA, and bf16 dot products against the fp32 path, one
layer of the default model's shape (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64).

    causal   2,048 new tokens attending to themselves (a fresh prompt)
    history  100 new tokens on 1K / 2K / 4K / 8K tokens of history
    agent    1,000 new tokens on 4K of history (an agent's step: a tool result and the next call)
    decode   one new token for each of 1 / 8 / 32 sequences on 512 tokens of context

Ours reads K and V from a paged pool (block 16, blocks in order) in place; SDPA gets them already
contiguous (the gather it would need from a paged pool is not counted) and, for history, the
causal offset mask. In bf16 the kernels are timed in two builds: this CPU's (bf16 dot products
where it has AVX512-BF16) and the fallback (`-mno-avx512bf16`: bf16 widened to fp32, what the
kernels did before and what a CPU without AVX512-BF16 runs); `*_dot_speedup` is fallback / ours.
In bf16, `flash` is the path long chunks take on a CPU with AMX (kernels/flash_prefill.py:
the sequence's K, V gathered from the pool, torch's flash kernel); `flash_speedup` is ours / flash.
The fused element-wise ops of a layer are timed at 2,048 rows too. Median of repeated calls; the
last line is one JSON object. --quick: causal 2K, history 1K and decode, fewer repetitions.

--variant times one ISA build of the kernels as "ours" (avx512_bf16, avx512, avx2, generic:
kernels/native.py; default the one this CPU serves), e.g. the AVX2 build on an AVX512 machine.

    python bench/attention_kernels.py [--dtype float32|bfloat16] [--quick] [--threads N]
                                      [--variant avx2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
from collections.abc import Callable

import torch
from engine_speed import median_seconds

from chatstore.kernels.flash_prefill import flash_prefill_sequence
from chatstore.kernels.fused_ops import NativeOps
from chatstore.kernels.native import (
    fallback_library,
    kernel_features,
    native_library,
    variant_library,
)
from chatstore.kernels.paged_attention import attend
from chatstore.kernels.paged_decode import make_decode_plan, paged_decode_native
from chatstore.kernels.paged_prefill import make_prefill_plan, paged_prefill_native

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M
HIDDEN, INTERMEDIATE = 576, 1536
DECODE_CONTEXT = 512  # as bench/engine_speed.py
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def median_ms(fn: Callable[[], object], reps: int) -> float:
    return 1e3 * median_seconds(fn, reps)


def builds(dtype: torch.dtype, variant: str | None = None) -> dict[str, ctypes.CDLL]:
    """The builds to time: this CPU's (or `variant`), and in bf16 the fp32-path fallback."""
    found = {"ours": variant_library(variant) if variant else native_library()}
    if dtype == torch.bfloat16:
        found["fallback"] = fallback_library()
    return {name: lib for name, lib in found.items() if lib is not None}


def prefill_case(
    new: int, context: int, dtype: torch.dtype, libs: dict[str, ctypes.CDLL], reps: int
) -> dict[str, float]:
    """ms per build and for SDPA, `new` tokens whose context is `context` tokens."""
    g = torch.Generator().manual_seed(context)
    blocks = (context + BLOCK - 1) // BLOCK
    q = torch.randn(new, HEADS, HEAD_DIM, generator=g).to(dtype)
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    plan = make_prefill_plan(torch.arange(blocks)[None], [new], [context])
    k, v = k_cache.flatten(0, 1)[:context], v_cache.flatten(0, 1)[:context]
    scale = HEAD_DIM**-0.5
    times = {
        name: median_ms(
            lambda lib=lib: paged_prefill_native(q, k_cache, v_cache, plan, scale, lib), reps
        )
        for name, lib in libs.items()
    }
    times["sdpa"] = median_ms(lambda: attend(q, k, v, scale), reps)
    if dtype == torch.bfloat16:
        out = torch.empty_like(q)
        table = plan.block_tables[0]
        times["flash"] = median_ms(
            lambda: flash_prefill_sequence(q, k_cache, v_cache, table, 0, new, context, scale, out),
            reps,
        )
    return times


def decode_case(
    batch: int, dtype: torch.dtype, libs: dict[str, ctypes.CDLL], reps: int
) -> dict[str, float]:
    """ms per build and for SDPA (per sequence, contiguous K, V), one token for each sequence."""
    g = torch.Generator().manual_seed(batch)
    per_seq = DECODE_CONTEXT // BLOCK
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    shape = (batch * per_seq, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    plan = make_decode_plan(tables, [DECODE_CONTEXT] * batch, BLOCK, torch.device("cpu"))
    scale = HEAD_DIM**-0.5
    times = {
        name: median_ms(
            lambda lib=lib: paged_decode_native(q, k_cache, v_cache, plan, scale, lib), reps
        )
        for name, lib in libs.items()
    }
    k = k_cache.view(batch, DECODE_CONTEXT, KV_HEADS, HEAD_DIM)
    v = v_cache.view(batch, DECODE_CONTEXT, KV_HEADS, HEAD_DIM)

    def sdpa() -> None:
        for s in range(batch):
            attend(q[s : s + 1], k[s], v[s], scale)

    times["sdpa"] = median_ms(sdpa, reps)
    return times


def fused_case(
    rows: int, dtype: torch.dtype, libs: dict[str, ctypes.CDLL], reps: int
) -> dict[str, dict[str, float]]:
    """ms of each fused op per build, at `rows` tokens."""
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    delta = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    w = torch.randn(HIDDEN, generator=g).to(dtype)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=g).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
    angles = torch.rand(rows, HEAD_DIM // 2, generator=g) * 50
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    slots = torch.arange(rows)
    k_cache = torch.zeros(rows, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    out: dict[str, dict[str, float]] = {}
    for name, lib in libs.items():
        ops = NativeOps(lib)
        out[name] = {
            "add_rms_norm": median_ms(lambda ops=ops: ops.add_rms_norm(h, delta, w, 1e-5), reps),
            "silu_mul": median_ms(lambda ops=ops: ops.silu_mul(gate_up), reps),
            "rope_store_kv": median_ms(
                lambda ops=ops: ops.rope_store_kv(
                    qkv, cos, sin, slots, k_cache, v_cache, HEADS, KV_HEADS, True
                ),
                reps,
            ),
        }
    return out


def report(name: str, times: dict[str, float], result: dict[str, object]) -> None:
    ours = times["ours"]
    line = f"{name:<28}{ours:>10.3f}{times.get('fallback', float('nan')):>12.3f}"
    line += f"{times['sdpa']:>10.3f}{times['sdpa'] / ours:>10.2f}x"
    result |= {f"{name}_ms_ours": round(ours, 3), f"{name}_ms_sdpa": round(times["sdpa"], 3)}
    result[f"{name}_speedup"] = round(times["sdpa"] / ours, 3)
    if "fallback" in times:
        line += f"{times['fallback'] / ours:>10.2f}x"
        result[f"{name}_ms_fallback"] = round(times["fallback"], 3)
        result[f"{name}_dot_speedup"] = round(times["fallback"] / ours, 3)
    if "flash" in times:
        line += f"{times['flash']:>10.3f}{ours / times['flash']:>10.2f}x"
        result[f"{name}_ms_flash"] = round(times["flash"], 3)
        result[f"{name}_flash_speedup"] = round(ours / times["flash"], 3)
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--variant", help="the ISA build to time as ours (default: this CPU's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    reps = 3 if args.quick else 10
    libs = builds(dtype, args.variant)
    if "ours" not in libs:
        raise SystemExit("attention_kernels: the native kernels are not available")
    bf16_dot = kernel_features(libs["ours"]).bf16_dot
    threads = torch.get_num_threads()
    variant = args.variant or "this CPU's"
    print(f"attention_kernels: {args.dtype}, {threads} threads, one layer, {variant} build, "
          f"bf16_dot={bf16_dot}")  # fmt: skip
    print(f"{'case':<28}{'ours ms':>10}{'fallback ms':>12}{'sdpa ms':>10}{'sdpa/ours':>11}", end="")
    print(f"{'fb/ours':>11}" if "fallback" in libs else "", end="")
    print(f"{'flash ms':>10}{'ours/flash':>11}" if dtype == torch.bfloat16 else "")
    result: dict[str, object] = {"dtype": args.dtype, "threads": threads, "bf16_dot": bf16_dot}
    result["kernel_variant"] = args.variant or "auto"
    histories = (1024,) if args.quick else (1024, 2048, 4096, 8000)
    cases = [("causal_2k", 2048, 2048)] + [
        (f"history_{round(n / 1024)}k", 100, n + 100) for n in histories
    ]
    cases.append(("agent_1000_on_4k", 1000, 5000))
    for name, new, context in cases:
        report(name, prefill_case(new, context, dtype, libs, reps), result)
    for batch in (1, 8, 32):
        report(f"decode_b{batch}", decode_case(batch, dtype, libs, 5 * reps), result)
    fused = fused_case(2048, dtype, libs, reps)
    for op, ms in fused["ours"].items():
        line = f"{op + ' (2048 rows)':<28}{ms:>10.3f}"
        result[f"{op}_2k_ms_ours"] = round(ms, 3)
        if "fallback" in fused:
            line += f"{fused['fallback'][op]:>12.3f}"
            result[f"{op}_2k_ms_fallback"] = round(fused["fallback"][op], 3)
        print(line)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
