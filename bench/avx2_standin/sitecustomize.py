"""vLLM-CPU as it runs on an AVX2-only CPU, on an AVX512 one (docs/benchmarks.md, issue 32).

vLLM loads its `_C_AVX2` kernels where `torch.cpu._is_avx512_supported()` says no; that probe
reads CPUID and ignores ATEN_CPU_CAPABILITY. With this folder on PYTHONPATH and AVX2_STANDIN=1,
every Python process (vLLM's server and its workers) gets probes that say no AVX512, BF16 or
AMX; beside ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2,
vLLM then computes with AVX2 alone. Without AVX2_STANDIN=1 it does nothing.
"""

import os

if os.environ.get("AVX2_STANDIN") == "1":
    try:
        import torch.cpu
    except ImportError:  # a Python without torch (llama.cpp's venv): nothing to hold
        pass
    else:
        torch.cpu._is_avx512_supported = lambda: False
        torch.cpu._is_avx512_bf16_supported = lambda: False
        torch.cpu._is_amx_tile_supported = lambda: False
