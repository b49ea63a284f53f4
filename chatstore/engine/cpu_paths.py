"""What each CPU path computes with on this machine, chosen at run time, in one log line.

Nothing here decides anything: `dtype = auto` (config.resolve_dtype: bf16 only where the CPU
computes it natively), the native kernels' ISA variant (kernels/native.py), oneDNN's prepacking
(linear.packing_available: not for bf16 where oneDNN cannot), the attention of long prefill chunks
(kernels/flash_prefill.py: torch's flash kernel for bf16 on AMX) and torch's own vector width each
choose for the CPU they run on. This says what they chose, once at start, so that a slow run
on an unusual CPU can be read from its log.
"""

from __future__ import annotations

import torch

from chatstore.config import cpu_has_fast_bf16
from chatstore.engine.linear import packing_available
from chatstore.kernels import native
from chatstore.kernels.flash_prefill import (
    FLASH_LONG_CONTEXT,
    FLASH_MIN_QUERY,
    FLASH_MIN_QUERY_LONG_CONTEXT,
    flash_prefill_enabled,
)

EMULATED_BF16 = (
    "bf16 was asked for on a CPU without AVX512-BF16 or AMX: torch and oneDNN emulate it here, "
    "so fp32 (dtype = auto) computes faster"
)


def describe_cpu_paths(dtype: torch.dtype) -> str:
    flags = native.cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    lib = native.native_library()
    kernels = "off (torch path)" if lib is None else native.selected_variant().name
    packed = packing_available(torch.device("cpu"), dtype)
    # Read at start, so that a bad CHATSTORE_FLASH_PREFILL fails here, not in a step.
    flash = (
        f"torch flash from {FLASH_MIN_QUERY} new tokens ({FLASH_MIN_QUERY_LONG_CONTEXT} on "
        f"{FLASH_LONG_CONTEXT}+ of context)"
        if flash_prefill_enabled(dtype)
        else "paged kernel"
    )
    return (
        f"CPU paths: cpu flags {'+'.join(isa) or 'none of avx2/avx512'}; compute dtype "
        f"{str(dtype).removeprefix('torch.')}; native kernels {kernels}; torch vectors "
        f"{torch.backends.cpu.get_cpu_capability()}; oneDNN prepacked weights "
        f"{'on' if packed else 'off'}; long prefill attention {flash}"
    )


def cpu_path_warnings(dtype: torch.dtype) -> list[str]:
    """What a setting chose against this CPU (one log line each at start)."""
    return [EMULATED_BF16] if dtype == torch.bfloat16 and not cpu_has_fast_bf16() else []
