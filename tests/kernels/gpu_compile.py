"""Compile every Triton kernel of chatstore.kernels.triton for a GPU, with no GPU present.

Run as a script (never under TRITON_INTERPRET, where `triton.jit` makes interpreted functions):

    python tests/kernels/gpu_compile.py [--arch 90]

Triton's whole pipeline runs (Python AST -> TTIR -> TTGIR -> LLVM IR -> PTX -> cubin through the
ptxas shipped in the wheel) for an NVIDIA target of compute capability --arch (90: H100/H200),
so what the interpreter accepts but a GPU compiler would not (loop-carried types, constexpr
arguments, dot shapes, masks) fails here. Each kernel in the shapes the launchers use for
SmolLM2 (9 q / 3 KV heads, D 64) and a Llama-3.2-1B shape (32 / 8 heads), bf16 and fp32.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("gpu_compile: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from chatstore.kernels.triton.kv_write import store_kv_kernel
from chatstore.kernels.triton.norm import rms_norm_kernel
from chatstore.kernels.triton.rope_kv import rope_store_kv_kernel
from chatstore.kernels.triton.silu import silu_mul_kernel
from chatstore.kernels.triton.split_kv import reduce_segments_kernel
from chatstore.kernels.triton.unified_attention import unified_attention_kernel

# Scalar arguments that are not strides (strides are i64, as torch passes them).
SCALARS = {
    "scale": "fp32",
    "eps": "fp32",
    "num_seqs": "i32",
    "num_heads": "i32",
    "width": "i32",
    "inner": "i32",
}
# Pointers whose element type is not the tensors' dtype.
POINTERS = {
    "block_tables_ptr": "i64",
    "seq_lens_ptr": "i32",
    "query_start_ptr": "i32",
    "slot_ptr": "i64",
    "part_out_ptr": "fp32",
    "part_max_ptr": "fp32",
    "part_sum_ptr": "fp32",
}


def signature(fn: Any, dtype: str, constants: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constants:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + POINTERS.get(name, dtype)
        elif name.startswith("stride_"):
            sig[name] = "i64"
        else:
            sig[name] = SCALARS[name]
    return sig


def attention(group: int, block_q: int, segments: int, tile: int, dtype: str) -> dict[str, Any]:
    return dict(
        GROUP=group,
        BLOCK_SIZE=16,
        TILE=tile,
        HEAD_DIM=64,
        HEAD_P2=64,
        BLOCK_Q=block_q,
        BLOCK_M=16,
        SEGMENTS=segments,
        EMULATE_BF16=False,
        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
    )


def cases() -> list[tuple[Any, str, dict[str, Any]]]:
    out: list[tuple[Any, str, dict[str, Any]]] = []
    for dtype in ("bf16", "fp32"):  # fp16 compiles as bf16 does (16-bit MMA)
        out += [
            (unified_attention_kernel, dtype, attention(3, 5, 1, 32, dtype)),  # SmolLM2 prefill
            (unified_attention_kernel, dtype, attention(3, 5, 16, 16, dtype)),  # split decode
            (unified_attention_kernel, dtype, attention(4, 4, 1, 16, dtype)),  # Llama-1B decode
        ]
    rope = dict(NUM_HEADS=9, NUM_KV_HEADS=3, HEAD_DIM=64, Q_HEADS_P2=16, KV_HEADS_P2=4)
    for dtype in ("bf16", "fp32"):
        out += [
            (reduce_segments_kernel, dtype, dict(HEAD_DIM=64, HEAD_P2=64, SEGMENTS=16)),
            (store_kv_kernel, dtype, dict(NUM_KV_HEADS=3, HEAD_DIM=64, HEADS_P2=4, HEAD_P2=64)),
            (rms_norm_kernel, dtype, dict(ADD=False, BLOCK=1024)),
            (rms_norm_kernel, dtype, dict(ADD=True, BLOCK=2048)),
            (rope_store_kv_kernel, dtype, dict(rope, HEAD_P2=64, WANT_KV=True)),
            (rope_store_kv_kernel, dtype, dict(rope, HEAD_P2=64, WANT_KV=False)),
            (silu_mul_kernel, dtype, dict(BLOCK=1024)),
        ]
    return [(fn, dtype, {**consts, "EMULATE_BF16": False}) for fn, dtype, consts in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    for fn, dtype, consts in cases():
        compiled = triton.compile(ASTSource(fn, signature(fn, dtype, consts), consts), target)
        if "cubin" not in compiled.asm:
            sys.exit(f"{fn.__name__} ({dtype}): no cubin")
        print(f"{fn.__name__} {dtype} {consts}: sm_{args.arch} cubin")


if __name__ == "__main__":
    main()
