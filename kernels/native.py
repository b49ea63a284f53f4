"""Native CPU kernels from `kernels/csrc`, built with gcc at first use and cached on disk.

The C sources include no torch headers, so a build takes a few seconds, even on 2 cores. Each
shared library is cached under `$CHATSTORE_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/chatstore/kernels` (`~/.cache/chatstore/kernels`), named by a hash of the
source, the flags, the compiler and the CPU (the builds are tuned with `-mtune=native`). It links
the `libgomp.so.1` that torch has already loaded, so torch's ops and these kernels share one
OpenMP thread pool.

**One variant per instruction set, chosen at run time.** The same sources compile to

    variant       gcc target                      vectors   bf16 attention
    avx512_bf16   x86-64-v4 + AVX512-BF16         512-bit   bf16 dot products (VDPBF16PS)
    avx512        x86-64-v4 (AVX512 F/BW/CD/DQ/VL) 512-bit   widened to fp32 on load
    avx2          x86-64-v3 (AVX2, FMA, BMI2)     256-bit   widened to fp32 on load
    generic       x86-64 (SSE2)                   128-bit   widened to fp32 on load

(`native` on other machines: `-march=native`). The best variant whose instructions the OS
reports in /proc/cpuinfo serves (`selected_variant()`; logged once), so no CPU ever meets an
instruction it lacks, and every variant this CPU can execute is built and tested by `make test`
(`runnable_variants()`), which is how the AVX2 path runs in CI on an AVX512 machine.
`CHATSTORE_KERNEL_ISA=<variant>` pins one (an error if this CPU cannot run it);
`CHATSTORE_BF16_DOT=0` serves the best variant without the bf16 dot-product path;
`CHATSTORE_NATIVE_KERNELS=0` turns the native kernels off. `CHATSTORE_HIDE_CPU_FLAGS=avx512*,amx*`
hides flags from every choice chatstore makes by the CPU (not only this one's), to run another
CPU kind's paths on this one (`make test-avx2`).

Anything that goes wrong building or loading (no compiler, a failed build) logs one warning and
`native_library()` returns None: callers then take their torch path.
`kernel_features(lib)` says what a loaded library computes with.
"""

from __future__ import annotations

import ctypes
import fnmatch
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch  # also loads torch's libgomp.so.1 before ours is linked to it

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
        "int4_matmul.c",
        "int4_vnni.c",
        "weight_dequant.c",
        "gguf_pack.c",
        "features.c",
    )
)
HEADERS = (CSRC / "common.h", CSRC / "vec.h", CSRC / "attention_bf16.h", CSRC / "act_quant.h")
# ISO C mode turns FMA contraction off: ask for it, or `a += b * c` stays two instructions.
# -fno-trapping-math: the kernels install no floating-point trap handlers, and without it gcc
# will not if-convert a loop whose float -> int conversion might trap (exp's 2^n), so on AVX2,
# which has no masked lanes, silu_mul and the decode softmax's exp stayed scalar (AVX512 builds
# vectorised them anyway); values are unchanged (not -ffast-math: IEEE rounding, NaN, inf kept).
CFLAGS = (
    "-O3",
    "-ffp-contract=fast",
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c11",
)
BUILD_TIMEOUT_S = 120
OFF_VALUES = ("0", "false", "no", "off")  # a switch set to any of these is off


class IsaVariant(NamedTuple):
    """One build of the kernels: the gcc target and the CPU flags (/proc/cpuinfo) it needs."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]


_V3 = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_TUNE = ("-mtune=native",)
# Best first: the first one this CPU can run serves.
X86_VARIANTS = (
    IsaVariant("avx512_bf16", ("-march=x86-64-v4", "-mavx512bf16", *_TUNE), _V4 | {"avx512_bf16"}),
    IsaVariant("avx512", ("-march=x86-64-v4", *_TUNE), _V4),
    IsaVariant("avx2", ("-march=x86-64-v3", *_TUNE), _V3),
    IsaVariant("generic", ("-march=x86-64", *_TUNE), frozenset()),
)
NATIVE_VARIANT = IsaVariant("native", ("-march=native",), frozenset())  # not x86-64

# The kernels' dtype argument: common.h's DTYPE_F32 / DTYPE_BF16.
NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# int paged_decode(dtype, q, k, v, tables, table_width, ctx_lens, S, Hq, Hkv, D, B, scale, out, n)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
PAGED_DECODE_ARGTYPES = [ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]
PAGED_DECODE_ARGTYPES += [_i64] * 5 + [ctypes.c_float, _ptr, ctypes.c_int]
# int paged_prefill(dtype, q, q_stride, k, v, tables, table_width, q_start, q_len, ctx_len, S,
#                   Hq, Hkv, D, B, scale, out, n)
PAGED_PREFILL_ARGTYPES = [ctypes.c_int, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr]
PAGED_PREFILL_ARGTYPES += [_i64] * 5 + [ctypes.c_float, _ptr, ctypes.c_int]
# The fused element-wise ops of fused_ops.c: (name, argtypes); all return void.
FUSED_ARGTYPES = {
    "rms_norm": [ctypes.c_int, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float],
    "add_rms_norm": [ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float],
    "rope_store_kv": [ctypes.c_int, *[_ptr] * 7, _i64, _i64, _i64, _i64],
    "silu_mul": [ctypes.c_int, _ptr, _ptr, _i64, _i64],
}
# int int4_matmul(dtype, x, T, K, repeat, packed, scales, mins, N, out, n)
INT4_MATMUL_ARGTYPES = [ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr]
INT4_MATMUL_ARGTYPES += [ctypes.c_int]
# weight_dequant.c and gguf_pack.c: (name, argtypes, restype)
_int = ctypes.c_int
DEQUANT_ARGTYPES = {
    # int int4pack_dequant(dtype, packed, scales_zeros, N, K, group, block_n, halves, out, n)
    "int4pack_dequant": ([_int, _ptr, _ptr, _i64, _i64, _i64, _i64, _int, _ptr, _int], _int),
    # void int4_native_dequant(dtype, packed, scales, mins, N, K, out, n)
    "int4_native_dequant": ([_int, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _int], None),
    # int int4pack_rows(dtype, packed, scales_zeros, N, K, group, block_n, halves, ids, T,
    #                   repeat, out, n)
    "int4pack_rows": (
        [_int, _ptr, _ptr, _i64, _i64, _i64, _i64, _int, _ptr, _i64, _i64, _ptr, _int],
        _int,
    ),
    # int int4_native_rows(dtype, packed, scales, mins, N, K, ids, T, repeat, out, n)
    "int4_native_rows": (
        [_int, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _int],
        _int,
    ),
    # void int8_dequant(dtype, q, scales, N, K, out, n)
    "int8_dequant": ([_int, _ptr, _ptr, _i64, _i64, _ptr, _int], None),
    # gguf_pack.c: int gguf_to_int4pack(row_addr, row_type, N, K_out, block_n, halves, packed,
    #                                    scales_zeros, n)
    "gguf_to_int4pack": ([_ptr, _ptr, _i64, _i64, _i64, _int, _ptr, _ptr, _int], _int),
    # int gguf_to_int4_native(row_addr, row_type, N, K_out, packed, scales, mins, n)
    "gguf_to_int4_native": ([_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _int], _int),
    # int4_vnni.c: int int4_vnni_built(void)
    "int4_vnni_built": ([], _int),
    # int int4pack_vnni_matmul(dtype, x, T, K, packed, scales_zeros, block_n, halves, symmetric,
    #                          N, out, n)
    "int4pack_vnni_matmul": (
        [_int, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int, _int, _i64, _ptr, _int],
        _int,
    ),
    # int int4_native_vnni_matmul(dtype, x, T, K, packed, scales, mins, symmetric, N, out, n)
    "int4_native_vnni_matmul": (
        [_int, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _ptr, _int],
        _int,
    ),
}
FEATURE_BF16_DOT = 1  # bits of kernel_features() in csrc/features.c
FEATURE_VECTOR_BITS_SHIFT = 8  # bits 8..: the width of the attention kernels' vectors


class KernelFeatures(NamedTuple):
    """What a loaded build computes with."""

    bf16_dot: bool  # bf16 on AVX512-BF16 dot products (else: widened to fp32 on load)
    vector_bits: int  # the width of the prefill kernel's lane vectors (512 or 256)


def cache_dir() -> Path:
    explicit = os.environ.get("CHATSTORE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "chatstore" / "kernels"


def _compiler() -> str:
    return os.environ.get("CC", "gcc")


@functools.cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags the OS reports for this CPU (empty where /proc/cpuinfo is unreadable), less
    those `CHATSTORE_HIDE_CPU_FLAGS` hides; read once. The one reader of the CPU's flags:
    config.py and the benchmarks ask here."""
    return hide_flags(flags_of(_cpuinfo()), os.environ.get("CHATSTORE_HIDE_CPU_FLAGS", ""))


def hide_flags(flags: frozenset[str], patterns: str) -> frozenset[str]:
    """`flags` without those matching any of the comma-separated shell patterns (`avx512*,amx*`).

    For testing another CPU kind's paths on this one (`make test-avx2`: what chatstore picks on an
    AVX2-only CPU, with torch, oneDNN and MKL held to AVX2 beside it). Hiding can only take a
    flag away, never add one, so no kernel is ever chosen for an instruction the CPU lacks."""
    hidden = [p.strip() for p in patterns.split(",") if p.strip()]
    return frozenset(f for f in flags if not any(fnmatch.fnmatchcase(f, p) for p in hidden))


def flags_of(cpuinfo: str) -> frozenset[str]:
    """The flags in the text of a /proc/cpuinfo (its first processor's)."""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_model() -> str:
    """The CPU's model name as the OS reports it ("unknown" where it does not)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "unknown"


def _cpu_identity() -> str:
    lines = _cpuinfo().splitlines()
    if not lines:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return platform.machine() + "".join(sorted(set(keep)))


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU reports AVX512-BF16 (Linux /proc/cpuinfo; False where unreadable)."""
    return "avx512_bf16" in cpu_flags()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def all_variants() -> tuple[IsaVariant, ...]:
    return X86_VARIANTS if _is_x86() else (NATIVE_VARIANT,)


def runnable_variants() -> list[IsaVariant]:
    """The variants this CPU can execute, best first (tests run every one of them)."""
    flags = cpu_flags()
    return [v for v in all_variants() if v.cpu_flags <= flags]


def variant(name: str) -> IsaVariant:
    """The variant of this name; ValueError naming the choices, or what this CPU lacks."""
    found = {v.name: v for v in all_variants()}
    if name not in found:
        raise ValueError(f"unknown kernel ISA {name!r}: one of {sorted(found)}")
    chosen = found[name]
    missing = chosen.cpu_flags - cpu_flags()
    if missing:
        raise ValueError(f"this CPU cannot run the {name} kernels: it lacks {sorted(missing)}")
    return chosen


def selected_variant() -> IsaVariant:
    """What serves: `CHATSTORE_KERNEL_ISA` when set, else the best this CPU runs, without the
    bf16 dot-product variant when `CHATSTORE_BF16_DOT=0`."""
    pinned = os.environ.get("CHATSTORE_KERNEL_ISA", "auto").strip().lower()
    if pinned not in ("", "auto"):
        return variant(pinned)
    no_dot = os.environ.get("CHATSTORE_BF16_DOT", "1").lower() in OFF_VALUES
    return next(v for v in runnable_variants() if not (no_dot and v.name == "avx512_bf16"))


def _build_key(cflags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(" ".join((*CFLAGS, *cflags)).encode())
    version = subprocess.run(
        [_compiler(), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    h.update(version.stdout.encode())
    h.update(_cpu_identity().encode())
    return h.hexdigest()[:16]


def build(cflags: tuple[str, ...]) -> Path:
    """Compile the sources with CFLAGS + cflags (or reuse the cached build); the library's path."""
    target = cache_dir() / f"chatstore_kernels_{_build_key(cflags)}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = " ".join(cflags)
    log.info("building the native CPU kernels (%s; first run only, a few seconds)", flags)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [_compiler(), *CFLAGS, *cflags, *map(str, SOURCES), "-o", tmp, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, target)  # atomic: concurrent builders never see a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def require_library(lib: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """`lib` (a particular build) or this CPU's kernels; RuntimeError when there are none."""
    lib = lib or native_library()
    if lib is None:
        raise RuntimeError("native kernels are not available")
    return lib


def native_library() -> ctypes.CDLL | None:
    """The loaded kernels of the selected variant, or None when they are turned off or cannot be
    built here. Called by every kernel call: the choice is made once per setting and CPU."""
    if os.environ.get("CHATSTORE_NATIVE_KERNELS", "1").lower() in OFF_VALUES:
        return None
    return _library_for(
        os.environ.get("CHATSTORE_KERNEL_ISA", ""),
        os.environ.get("CHATSTORE_BF16_DOT", ""),
        cpu_flags(),
    )


@functools.cache
def _library_for(isa: str, bf16_dot: str, flags: frozenset[str]) -> ctypes.CDLL | None:
    """native_library()'s choice for these settings and CPU flags (the arguments are the key)."""
    chosen = selected_variant()
    _log_choice(chosen.name)
    return variant_library(chosen.name)


@functools.cache
def _log_choice(name: str) -> None:
    log.info(
        "native CPU kernels: the %s variant (of %s this CPU runs)",
        name,
        ", ".join(v.name for v in runnable_variants()),
    )


def fallback_library() -> ctypes.CDLL | None:
    """The best variant this CPU runs without AVX512-BF16 instructions (the fp32 path)."""
    plain = next((v for v in runnable_variants() if v.name != "avx512_bf16"), None)
    return None if plain is None else variant_library(plain.name)


def kernel_features(lib: ctypes.CDLL) -> KernelFeatures:
    bits = lib.kernel_features()
    return KernelFeatures(
        bf16_dot=bool(bits & FEATURE_BF16_DOT), vector_bits=bits >> FEATURE_VECTOR_BITS_SHIFT
    )


def variant_library(name: str) -> ctypes.CDLL | None:
    """The kernels of one variant (which this CPU must be able to run), loaded; None (and a
    warning) when they cannot be built."""
    return _load(variant(name).cflags)


@functools.cache
def _load(cflags: tuple[str, ...]) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build(cflags)))
        lib.paged_decode.argtypes = PAGED_DECODE_ARGTYPES
        lib.paged_decode.restype = ctypes.c_int
        lib.paged_prefill.argtypes = PAGED_PREFILL_ARGTYPES
        lib.paged_prefill.restype = ctypes.c_int
        lib.int4_matmul.argtypes = INT4_MATMUL_ARGTYPES
        lib.int4_matmul.restype = ctypes.c_int
        lib.kernel_features.argtypes = []
        lib.kernel_features.restype = ctypes.c_int
        for name, argtypes in FUSED_ARGTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = None
        for name, (argtypes, restype) in DEQUANT_ARGTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = restype
    except Exception as exc:
        log.warning("native CPU kernels unavailable, using the torch path: %s", exc)
        return None
    return lib
