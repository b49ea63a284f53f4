"""Native CPU kernels from `kernels/csrc`, built with gcc at first use and cached on disk.

The C sources include no torch headers, so a build takes a few seconds, even on 2 cores. The
shared library is cached under `$CHATSTORE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/chatstore/kernels`
(`~/.cache/chatstore/kernels`), named by a hash of the source, the flags, the compiler and the CPU
(the build uses `-march=native`). It links the `libgomp.so.1` that torch has already loaded, so
torch's ops and these kernels share one OpenMP thread pool.

Anything that goes wrong (no compiler, a failed build, a failed load) logs one warning and
`native_library()` returns None: callers then take their torch path. `CHATSTORE_NATIVE_KERNELS=0`
turns the native kernels off; `CHATSTORE_BF16_DOT=0` serves the fallback build below (the fp32
path) on any CPU, to compare the two in the engine or to rule the dot-product path out.

What runs where is decided when the library is built, for the CPU it is built on: with
AVX512-BF16 (`-march=native` defines `__AVX512BF16__`), bf16 attention and the rms norm's sum of
squares use bf16 dot products with fp32 accumulation; without it the same sources compile to the
fp32 path (bf16 widened on load), so no CPU ever meets an instruction it lacks.
`kernel_features(lib)` says which path a loaded library has; `fallback_library()` is the same
kernels built with `-mno-avx512bf16` (what a CPU without it runs), for tests and benchmarks.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch  # noqa: F401  (loads torch's libgomp.so.1 before ours is linked to it)

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_decode.c",
        "paged_decode_bf16.c",
        "paged_prefill.c",
        "paged_prefill_bf16.c",
        "fused_ops.c",
        "features.c",
    )
)
HEADERS = (CSRC / "common.h", CSRC / "vec16.h", CSRC / "attention_bf16.h")
# ISO C mode turns FMA contraction off: ask for it, or `a += b * c` stays two instructions.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=c11")
# Extra flags of the fallback build: the fp32 path, as on a CPU without AVX512-BF16.
NO_BF16_DOT = ("-mno-avx512bf16",)
BUILD_TIMEOUT_S = 120
_OFF = ("0", "false", "no", "off")

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# int paged_decode(dtype, q, k, v, tables, table_width, ctx_lens, S, Hq, Hkv, D, B, scale, out, n)
PAGED_DECODE_ARGTYPES = [ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]
PAGED_DECODE_ARGTYPES += [_i64] * 5 + [ctypes.c_float, _ptr, ctypes.c_int]
# int paged_prefill(dtype, q, k, v, tables, table_width, q_start, q_len, ctx_len, S, Hq, Hkv, D,
#                   B, scale, out, n)
PAGED_PREFILL_ARGTYPES = [ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr]
PAGED_PREFILL_ARGTYPES += [_i64] * 5 + [ctypes.c_float, _ptr, ctypes.c_int]
# The fused element-wise ops of fused_ops.c: (name, argtypes); all return void.
FUSED_ARGTYPES = {
    "rms_norm": [ctypes.c_int, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float],
    "add_rms_norm": [ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float],
    "rope_store_kv": [ctypes.c_int, *[_ptr] * 7, _i64, _i64, _i64, _i64],
    "silu_mul": [ctypes.c_int, _ptr, _ptr, _i64, _i64],
}
FEATURE_BF16_DOT = 1  # bit of kernel_features() in csrc/features.c


class KernelFeatures(NamedTuple):
    """What a loaded build computes with."""

    bf16_dot: bool  # bf16 on AVX512-BF16 dot products (else: widened to fp32 on load)


def cache_dir() -> Path:
    explicit = os.environ.get("CHATSTORE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "chatstore" / "kernels"


def _compiler() -> str:
    return os.environ.get("CC", "gcc")


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return platform.machine() + "".join(sorted(set(keep)))


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU reports AVX512-BF16 (Linux /proc/cpuinfo; False where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return "avx512_bf16" in flags.split()


def _build_key(extra_cflags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(" ".join((*CFLAGS, *extra_cflags)).encode())
    version = subprocess.run(
        [_compiler(), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    h.update(version.stdout.encode())
    h.update(_cpu_identity().encode())
    return h.hexdigest()[:16]


def build(extra_cflags: tuple[str, ...] = ()) -> Path:
    """Compile the sources (or reuse the cached build); the path of the shared library."""
    target = cache_dir() / f"chatstore_kernels_{_build_key(extra_cflags)}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the native CPU kernels with %s (first run only, a few seconds)", _compiler())
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [_compiler(), *CFLAGS, *extra_cflags, *map(str, SOURCES), "-o", tmp, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, target)  # atomic: concurrent builders never see a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def native_library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when they are turned off or cannot be built here."""
    if os.environ.get("CHATSTORE_NATIVE_KERNELS", "1").lower() in _OFF:
        return None
    if os.environ.get("CHATSTORE_BF16_DOT", "1").lower() in _OFF:
        return fallback_library()
    return _this_cpu_library()


@functools.cache
def _this_cpu_library() -> ctypes.CDLL | None:
    """The -march=native build, unless it has the bf16 dot-product path and the OS does not report
    AVX512-BF16 (gcc asks CPUID, the kernel may mask a feature it does not support): then the
    fallback, so that an instruction the OS would fault on is never run."""
    lib = load_library()
    if lib is not None and kernel_features(lib).bf16_dot and not cpu_has_avx512_bf16():
        log.warning("the kernels were built with AVX512-BF16 the OS does not report: fp32 path")
        return fallback_library()
    return lib


def fallback_library() -> ctypes.CDLL | None:
    """The kernels without AVX512-BF16 instructions (the fp32 path), or None if not buildable."""
    return load_library(NO_BF16_DOT)


def kernel_features(lib: ctypes.CDLL) -> KernelFeatures:
    return KernelFeatures(bf16_dot=bool(lib.kernel_features() & FEATURE_BF16_DOT))


@functools.cache
def load_library(extra_cflags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernels built with CFLAGS plus extra_cflags, loaded; None (and a warning) on failure."""
    try:
        lib = ctypes.CDLL(str(build(extra_cflags)))
        lib.paged_decode.argtypes = PAGED_DECODE_ARGTYPES
        lib.paged_decode.restype = ctypes.c_int
        lib.paged_prefill.argtypes = PAGED_PREFILL_ARGTYPES
        lib.paged_prefill.restype = ctypes.c_int
        lib.kernel_features.argtypes = []
        lib.kernel_features.restype = ctypes.c_int
        for name, argtypes in FUSED_ARGTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = None
    except Exception as exc:
        log.warning("native CPU kernels unavailable, using the torch path: %s", exc)
        return None
    return lib
