"""Large host buffers go back to the OS when freed: glibc's mmap threshold, pinned.

glibc serves an allocation above its mmap threshold with its own mapping, unmapped at free; one
below it comes from the heap, whose freed space stays resident. The threshold starts at 128 KiB
and moves up to the size of each mapped chunk freed (up to 32 MiB), so after the first large
step's activations (a 2,048-token prefill of an 8B model: tens of MB each) later buffers of up to
that size land in the heap and their pages stay in the process after the step. Measured with the
8B-shape Q4_0 file (`bench/model_sizes.py --shapes 8b`, AMD EPYC, 2 cores, after a 2K prefill and
a decode): steady RSS 5,778 MB with glibc's default, 5,533 MB with the threshold pinned at
4 MiB, prefill and decode speed unchanged within run-to-run noise; on the default model the 2K
prefill ran at 2,456 vs 2,465 tok/s. A pinned threshold also stops the dynamic adjustment.

The server pins it at start (`run_server`); MALLOC_MMAP_THRESHOLD_ in the environment (glibc's
own tunable) wins, and a libc without mallopt (musl, macOS) leaves the allocator as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3  # malloc.h


def pin_mmap_threshold(
    nbytes: int = MMAP_THRESHOLD_BYTES, environ: Mapping[str, str] | None = None
) -> int | None:
    """Allocations of `nbytes` and more are mapped, and unmapped at free, from now on in this
    process. Returns the threshold set, or None where it was left alone (set by the
    environment, or no glibc)."""
    env = os.environ if environ is None else environ
    if "MALLOC_MMAP_THRESHOLD_" in env:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, nbytes) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) failed; the heap keeps its default", nbytes)
        return None
    return nbytes
