"""bench/avx2_standin: with AVX2_STANDIN=1 a Python process's torch says the CPU has no AVX512
(what makes vLLM load its AVX2 kernels); without it, the probes are the CPU's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

STANDIN = Path(__file__).resolve().parents[2] / "bench" / "avx2_standin"
PROBE = (
    "import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported())"
)


def probe(**env: str) -> str:
    run_env = {**os.environ, "PYTHONPATH": str(STANDIN), **env}
    out = subprocess.run([sys.executable, "-c", PROBE], env=run_env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_standin_hides_avx512_only_when_asked():
    assert probe(AVX2_STANDIN="1") == "False False"
    real = f"{torch.cpu._is_avx512_supported()} {torch.cpu._is_avx512_bf16_supported()}"
    assert probe(AVX2_STANDIN="0") == real
