"""The native kernels, torch's CPU paths and the runner on a CPU without AVX512, emulated.

The machines this suite has run on so far have AVX512. `make test-avx2` and the variant tests
choose the AVX2 paths by hiding flags, but what they choose still executes on an AVX512 CPU: a
stray 512-bit instruction in the AVX2 build, or a library that asks CPUID rather than
/proc/cpuinfo (oneDNN refusing to prepack bf16 weights without avx512bw, torch's own kernel
dispatch), passes there and fails on the AVX2-only machines issue 32 found red.

QEMU's user-mode emulator with `-cpu max` is an AVX2-only CPU as CPUID and the instruction
decoder see it (its TCG runs AVX, AVX2, FMA and F16C, and no AVX512, AVX-VNNI or AMX at all): an
AVX512 instruction is SIGILL there, and torch reports AVX2. Under it this runs the kernel tests
of every variant that CPU can execute, the default model's forward against transformers, and
`chatstore serve` on its defaults (`weights = auto`: the GGUF's int4) through a two-turn session
whose second turn comes from the store, against the same paths run natively.

What the emulator does not model: /proc/cpuinfo is the host's (qemu-user passes it through), so
the child hides the AVX512 flags as `make test-avx2` does; speed (TCG is ~30x slower than the
host, so only the tests that prove a path's results run here, the rest stay native); the SSD
tier's 64 GiB LMDB map (qemu-user reserves a mapping's address space up front, which the host's
overcommit refuses), so the emulated server's SSD tier is 1 GiB.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chaos.harness import ServerProcess

QEMU = shutil.which("qemu-x86_64")
ROOT = Path(__file__).resolve().parents[2]
HIDDEN = "avx512*,amx*,avx_vnni*,avx_ne_convert*"
# The kernel files whose results depend on the ISA; the GPU path's Triton tests (interpreted,
# ISA-independent), the AMX-only flash prefill and the multi-minute ones stay native.
KERNEL_TESTS = [
    "tests/kernels/test_kernel_variants.py",
    "tests/kernels/test_kernels.py",
    "tests/kernels/test_kernels_bf16.py",
    "tests/kernels/test_kernels_prefill.py",
    "tests/kernels/test_fused_ops.py",
    "tests/kernels/test_fused_ops_cpu.py",
    "tests/kernels/test_int4_vnni.py",
    "tests/kernels/test_weight_dequant.py",
]
RUNNER_TEST = (
    "tests/engine/test_runner_exact.py::test_default_model_logits_match_transformers"
    "[auto-0.0003-paged]"
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates an x86-64 CPU"),
    pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 missing (make test installs qemu-user)"),
]


def _emulated(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """argv run by the emulated AVX2-only CPU, with torch, oneDNN and MKL left to ask it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
        and not k.startswith("PYTEST_")
    }
    env["CHATSTORE_HIDE_CPU_FLAGS"] = HIDDEN
    assert QEMU is not None
    return subprocess.run(
        [QEMU, "-cpu", "max", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_emulated_cpu_faults_on_avx512_and_torch_sees_avx2(tmp_path):
    """What makes the runs below mean something: an AVX512 instruction does not execute."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "avx512.c"
    src.write_text(
        "#include <immintrin.h>\n#include <stdio.h>\n"
        "int main(int argc, char **argv) {\n"
        "  volatile float x = (float)argc;\n"
        "  __m512 v = _mm512_set1_ps(x);\n"
        '  printf("%f\\n", _mm512_reduce_add_ps(_mm512_mul_ps(v, v)));\n'
        "  return 0;\n}\n"
    )
    exe = tmp_path / "avx512"
    subprocess.run([cc, "-O2", "-mavx512f", str(src), "-o", str(exe)], check=True, timeout=60)
    ran = _emulated([str(exe)], timeout=60)
    assert ran.returncode == -signal.SIGILL, (ran.returncode, ran.stdout, ran.stderr[-2000:])

    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    seen = _emulated([sys.executable, "-c", probe], timeout=300)
    assert seen.returncode == 0, seen.stderr[-4000:]
    assert seen.stdout.split()[-1] == "AVX2", seen.stdout


def test_kernels_and_the_runner_pass_on_an_avx2_only_cpu():
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
    ran = _emulated([*argv, *KERNEL_TESTS, RUNNER_TEST], timeout=840)
    tail = (ran.stdout + ran.stderr)[-6000:]
    assert ran.returncode == 0, tail
    # the kernel conftest's summary: the variants run, and the one that would serve
    assert "native kernel variants tested: avx2, generic (serving: avx2)" in ran.stdout, tail
    assert " passed" in ran.stdout and " failed" not in ran.stdout, tail


# What `make test-avx2` sets: the same paths on the host's AVX512 CPU, the reference.
AVX2_PATHS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "CHATSTORE_HIDE_CPU_FLAGS": HIDDEN,
}


def _two_turns(server: ServerProcess) -> list[tuple[int, str]]:
    """(cached prompt tokens, reply) of a two-turn session, greedy."""
    turns = []
    with server.client(timeout_s=300) as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
        for text in ("Name three colours of the rainbow.", "Which of them is warmest?"):
            body = {"content": text, "temperature": 0, "max_tokens": 12}
            r = http.post(f"/v1/sessions/{sid}/messages", json=body)
            assert r.status_code == 200, r.text
            reply = r.json()
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            turns.append((cached, reply["message"]["content"]))
    return turns


def test_a_served_session_on_an_avx2_only_cpu_matches_the_same_paths_native(tmp_path):
    env = {"CHATSTORE_SSD_BYTES": str(1 << 30), **AVX2_PATHS}
    emulated = ServerProcess(tmp_path / "emulated", env, runner=(QEMU or "", "-cpu", "max"))
    with emulated.start(timeout_s=300):
        paths = emulated.log_lines("CPU paths:")
        served = _two_turns(emulated)
    assert paths and "cpu flags avx2; compute dtype float32; native kernels avx2" in paths[0]
    assert "torch vectors AVX2" in paths[0], paths
    assert served[1][0] > 0, served  # the second turn's history came from the store
    with ServerProcess(tmp_path / "native", env) as native:
        assert _two_turns(native) == served
