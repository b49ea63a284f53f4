"""Fixtures of the kernel tests: the native CPU kernels of every ISA variant this CPU runs
(`variant_lib`), and the GPU path's Triton kernels, run on CPU tensors by Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated (`triton.jit`), that is when a module of
`chatstore.kernels.triton` is first imported, so it is set here, before any test module of this
folder imports one. Nothing else in the suite imports those modules (the CPU path never does).
"""

from __future__ import annotations

import ctypes
import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"

from chatstore.kernels.native import runnable_variants, variant_library


@pytest.fixture(params=[v.name for v in runnable_variants()])
def variant_lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """The native kernels of each ISA variant this CPU can execute (avx512_bf16, avx512, avx2,
    generic on an AVX512-BF16 machine): a test taking it runs once per variant."""
    lib = variant_library(request.param)
    if lib is None:
        pytest.skip(f"the {request.param} kernels do not build here (no gcc?)")
    return lib
