"""Keep freed activation memory in the process for reuse instead of handing it back to the OS.

A forward step allocates its activations afresh (at 2K tokens, ~65 MB per layer: q/k/v, the
gate/up product, ...). glibc serves blocks above its mmap threshold (128 KiB to 32 MiB, adaptive)
with fresh `mmap`s and unmaps them on free, so every step page-faults and zeroes all of it
again: measured here, a 2,048-token fp32 prefill of the default model took 4.9 s that way and
2.3 s with the thresholds raised (every GEMM, norm and the attention ran ~2x slower on cold
pages). vLLM's CPU backend asks for tcmalloc through LD_PRELOAD for the same reason; raising
glibc's thresholds gets the reuse without a preload. The price: the process keeps the peak of
its activations resident (tens to a few hundred MB, bounded by `max_tokens_per_step`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# mallopt(int param, int value): both values must fit a C int (at most 2**31 - 1). ctypes
# wraps a larger one silently (2 << 30 arrived as -2**31, which glibc took as a trim threshold
# of ~2**64: the heap top was never returned), and mallopt still answers 1.
MMAP_THRESHOLD = 1 << 30  # blocks below this come from the heap and are reused
# Free heap top kept up to this much before it is returned: as large as the largest block the
# heap serves, so freeing one activation block does not hand its pages back before the next
# step takes them again; a process that frees more than that at once gives the rest back.
TRIM_THRESHOLD = 1 << 30
MALLOPT_ARGS = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where it does not apply
    (another libc, or CHATSTORE_MALLOC_TUNING=0)."""
    if os.environ.get("CHATSTORE_MALLOC_TUNING", "1").lower() in ("0", "false", "no", "off"):
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all([mallopt(param, value) == 1 for param, value in MALLOPT_ARGS])
    if not ok:
        log.warning("mallopt refused the thresholds: activations are mmapped afresh each step")
    return ok


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim(0)`, which also releases
    whole free pages inside the heap). Called once a model's weights are built: each layer's
    tensors are read from the file in the compute dtype, repacked and dropped, and with the
    thresholds above that memory would otherwise stay resident (measured on the embedded model:
    ~40-180 MB). False where it does not apply."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


def _libc_function(name: str) -> ctypes._NamedFuncPointer | None:
    """The C library's function `name`, or None where there is no such libc or function."""
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    try:
        return getattr(ctypes.CDLL(lib), name)
    except (OSError, AttributeError):
        return None


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the OS zeroes at first touch (an anonymous map): the KV
    pool. `torch.zeros` writes every byte at once, so a 1 GiB pool cost 0.5 s of start and
    1 GiB of RSS before the first request; mapped so, a pool holds only the blocks used."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes)  # MAP_PRIVATE | MAP_ANONYMOUS: zero-filled pages
    # the tensor keeps `region` alive (frombuffer holds a reference to it)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
