"""What machine a benchmark ran on: CPU model, instruction sets, the kernel variant serving and
torch's vector width (every benchmark that claims a number names these, issue 32), and what a
process holds in memory."""

from __future__ import annotations

from pathlib import Path

import torch

from chatstore.kernels import native


def cpu_model() -> str:
    return native.cpu_model()


def cpu_isa() -> str:
    """The widest vector ISA the OS reports: AVX2, AVX512, AVX512-BF16, with +AMX when present."""
    flags = native.cpu_flags()
    if "avx512_bf16" in flags:
        isa = "AVX512-BF16"
    elif "avx512f" in flags:
        isa = "AVX512"
    elif "avx2" in flags:
        isa = "AVX2"
    else:
        isa = "other"
    return isa + ("+AMX" if "amx_bf16" in flags else "")


def machine_report() -> dict[str, object]:
    return {
        "cpu_model": cpu_model(),
        "cpu_isa": cpu_isa(),
        "kernel_variant": native.selected_variant().name,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def describe() -> str:
    m = machine_report()
    return (
        f"{m['cpu_model']} ({m['cpu_isa']}), kernels {m['kernel_variant']}, torch "
        f"{m['torch_cpu_capability']}, {m['threads']} threads"
    )


def proc_status_mb(pid: int | str = "self", key: str = "VmRSS") -> float:
    """A memory line of /proc/PID/status (VmRSS, VmHWM, ...) in MiB; 0.0 where it is absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0
