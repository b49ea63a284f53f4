"""bench/gpu_check.py --device cpu --quick: the device check runs end to end on a CPU, so it
cannot rot before a GPU runs it. Its exactness part is a real check here too (fp32 logits and
greedy tokens against transformers, fresh and restored from DRAM and from LMDB); its timings
on a CPU mean nothing and are only checked to be measured."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from chatstore.kernels.native import cache_dir, native_library

ROOT = Path(__file__).resolve().parents[2]
SPEED_KEYS = (
    "gpu_decode_b1_tok_s",
    "gpu_decode_b32_tok_s",
    "gpu_prefill_2k_tok_s",
    # The decode graph path, run on a CPU without capture.
    "gpu_decode_b1_tok_s_graph",
    "gpu_decode_b32_tok_s_graph",
    "gpu_graph_speedup_b1",
)
GPU_ONLY = ("gpu_name", "h2d_pinned_gbps", "d2h_pinned_gbps", "d2d_gbps")


def test_quick_cpu_run(tmp_path: Path) -> None:
    home, tmp, out = tmp_path / "home", tmp_path / "tmp", tmp_path / "out"
    home.mkdir()
    tmp.mkdir()
    xdg = {f"XDG_{kind}_HOME": str(home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}
    env = dict(os.environ, HOME=str(home), TMPDIR=str(tmp), **xdg)
    env.pop("TRITON_INTERPRET", None)
    # The check keeps the native CPU kernels' build under --out too: hand it this machine's
    # build (made here if the suite has not yet) instead of a 15 s gcc run.
    native_library()
    (out / "kernel-cache").mkdir(parents=True)
    for lib in cache_dir().glob("*.so"):
        shutil.copy2(lib, out / "kernel-cache" / lib.name)
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}, result["errors"]
    assert result["gpu_exact_ok"] is True
    assert result["gpu_max_logit_diff"] <= 1e-4  # fp32 on a CPU: the runner's own bar
    assert set(result["greedy_equal"]) == {"fresh", "fresh_ssd", "dram", "ssd"}
    for part in (result, result["llama1b"]):
        for key in SPEED_KEYS:
            assert part[key] > 0, key
        assert part["gpu_decode_b1_roofline_pct"] is None  # no HBM rate measured on a CPU
    # None when the serial load timed no slower than resident compute (CPU timing noise).
    hidden = result["gpu_load_hidden_pct"]
    assert hidden is None or 0 <= hidden <= 100
    for key in GPU_ONLY:
        assert result[key] is None, key
    # Everything it wrote is under --out: nothing in the home or temporary folder.
    assert not any(home.iterdir()) and not any(tmp.iterdir())
    assert {"store-dram", "store-ssd", "store-load"} <= {p.name for p in out.iterdir()}
