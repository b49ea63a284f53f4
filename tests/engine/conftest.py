"""Fixtures of the engine and kernel tests."""

from __future__ import annotations

import ctypes

import pytest

from chatstore.kernels.native import runnable_variants, variant_library


@pytest.fixture(params=[v.name for v in runnable_variants()])
def variant_lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """The native kernels of each ISA variant this CPU can execute (avx512_bf16, avx512, avx2,
    generic on an AVX512-BF16 machine): a test taking it runs once per variant."""
    lib = variant_library(request.param)
    if lib is None:
        pytest.skip(f"the {request.param} kernels do not build here (no gcc?)")
    return lib
