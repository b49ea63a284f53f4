"""Per-shape timing of the default model's projections: 16-bit (linear.Linear) vs int8 vs int4.

    .venv/bin/python bench/quant_shapes.py [--dtype bfloat16|float32] [--quick]

Each row is one projection of SmolLM2-135M (qkv, o_proj, gate_up, down, lm_head) at 1, 8, 32
and 2000 tokens (lm_head at 1, 8, 32: it sees one row a sequence, and also as a GGUF Q8_0 tensor
carried on two int4 halves, `gguf_repack`); a layer projection is timed over `--layers` distinct
random weights called one after another (the 30 layers' weights stream from DRAM as in a real
step), lm_head over one.
Prints ms per call of each path and, last, JSON. `chatstore/engine/weight_plan.py` holds the
table this printed and the choice it led to.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatstore.config import DTYPES
from chatstore.engine.linear import Linear, packing_available
from chatstore.engine.quant_linear import Int4Linear, Int8Linear
from chatstore.model.gguf_repack import repack
from chatstore.model.quant_weights import quantize_int4, quantize_int8

# (name, N, K) of SmolLM2-135M-Instruct: hidden 576, 9 q heads + 2 * 3 kv heads of 64, MLP 1536
SHAPES = (
    ("qkv", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
)
TOKENS = (1, 8, 32, 2000)


def build(kind: str, w: torch.Tensor, dtype: torch.dtype):
    if kind == "16-bit":
        return Linear(w.to(dtype), None, packing_available(w.device, dtype))
    if kind == "int8":
        return Int8Linear(quantize_int8(w), None)
    if kind == "q8_0-2xint4":  # a GGUF Q8_0 tensor as gguf_repack carries it
        n, k = w.shape
        blocks = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
        return Int4Linear(repack("Q8_0", blocks, n, k), None)
    return Int4Linear(quantize_int4(w, int(kind.removeprefix("int4-g"))), None)


def time_calls(projs: list, x: torch.Tensor, min_s: float) -> float:
    """ms per call: the fastest whole pass through `projs` within `min_s` (at least 3 passes).

    The fastest pass, not the mean: on a shared 2-core machine a pass now and then stalls for
    a scheduler slice (~8 ms) while the other thread waits at the OpenMP barrier."""
    for p in projs:
        p(x)  # warm-up: first-call allocations and oneDNN primitive creation
    best, passes, start = float("inf"), 0, time.perf_counter()
    while passes < 3 or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        for p in projs:
            p(x)
        best = min(best, time.perf_counter() - t0)
        passes += 1
    return 1e3 * best / len(projs)


def measure(dtype: torch.dtype, layers: int, tokens: tuple[int, ...], min_s: float) -> dict:
    kinds = ("16-bit", "int8", "int4-g32", "int4-g64")
    results: dict = {}
    for name, n, k in SHAPES:
        head = name == "lm_head"
        copies = 1 if head else layers
        weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
        for kind in (*kinds, "q8_0-2xint4") if head else kinds:
            projs = [build(kind, w, dtype) for w in weights]
            # lm_head sees one row per sequence (logits of the last token only), never a prompt
            for t in [t for t in tokens if t <= 32] if head else tokens:
                x = torch.randn(t, k).to(dtype)
                ms = time_calls(projs, x, min_s)
                results.setdefault(name, {}).setdefault(str(t), {})[kind] = round(ms, 4)
                print(f"{name:8s} T={t:5d} {kind:9s} {ms:8.3f} ms", flush=True)
            del projs
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    parser.add_argument("--quick", action="store_true", help="2 layers, 1 and 8 tokens, short")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    layers, tokens, min_s = args.layers, TOKENS, 0.5
    if args.quick:
        layers, tokens, min_s = 2, (1, 8), 0.02
    results = measure(DTYPES[args.dtype], layers, tokens, min_s)
    out = {"dtype": args.dtype, "threads": torch.get_num_threads(), "ms": results}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
