"""Triton kernels for the CUDA path, imported as `chatstore.kernels.triton`.

    unified_attention   one launch for prefill, decode and mixed batches over the block tables,
                        with a split-KV variant for long decode contexts (split_kv.py reduces it)
    kv_write            k, v rows into the paged pool at their slots
    fused_ops           TritonOps: rms_norm, add_rms_norm, rope_store_kv, silu_mul with the
                        contract of `chatstore.kernels.fused_ops` (NativeOps / TorchOps)

This package imports nothing from Triton itself: only its submodules do, and only the CUDA path
imports them, so the CPU path never needs Triton installed. CPU CI runs the same kernels with
`TRITON_INTERPRET=1` on CPU tensors (tests/kernels/); none of them has run on a GPU yet.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def available() -> bool:
    """Whether Triton is installed (found without importing it)."""
    return importlib.util.find_spec("triton") is not None
