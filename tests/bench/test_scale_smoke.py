"""bench/scale.py at tiny sizes: it populates, serves, converses, runs two replicas over one Redis,
and prints its keys on the last line (no speed is asserted: the bench's numbers are the lead's)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.redis_server import redis_server_binary

ROOT = Path(__file__).resolve().parents[2]
HEADLINE = (
    "start_s_100k",
    "turn_overhead_ratio_100k",
    "prefix_match_ms_100k",
    "purge_s_100k",
    "rss_mb_per_1k_sessions",
    "writer_cpu_ratio_turn40",
    "cross_replica_deletes",
    "shared_prompt_reuse_share",
)
PER_SIZE = (
    "start_s",
    "store_start_s",
    "turn_overhead_ms",
    "writer_cpu_ms",
    "rss_mb",
    "prefix_match_ms",
    "purge_s",
    "disk_mb",
    "population_s",
)

pytestmark = [
    pytest.mark.model,
    pytest.mark.slow,
    pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed"),
]


def test_a_tiny_run_prints_every_key(tmp_path):
    cache = tmp_path / "cache"
    cmd = [sys.executable, str(ROOT / "bench" / "scale.py"), "--sizes", "10,20", "--turns", "7"]
    cmd += ["--small-turns", "3", "--pool", "3", "--replica-sessions", "1", "--no-progress"]
    cmd += ["--cache", str(cache)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in HEADLINE:
        assert isinstance(result[key], int | float) and math.isfinite(result[key]), key
    assert result["headline_size"] == 20 and result["baseline_size"] == 10
    assert set(result["goals"]) <= set(result)
    assert result["cpu"] and result["storage_dtype"] in ("bfloat16", "float32", "float16", "int8")
    for size in ("10", "20"):
        numbers = result["per_size"][size]
        for key in PER_SIZE:
            assert numbers[key] >= 0, (size, key)
        assert numbers["sessions_counted"] == int(size)  # the population, the live one gone
        assert numbers["prefix_matched"] == 1.0  # a resent stored history finds its session
    assert 0.0 <= result["shared_prompt_reuse_share"] <= 1.0
    assert result["cross_replica_deletes"] >= 0
    # Populated dirs are cached for the next run, keyed by size and pool.
    assert sorted(p.name for p in cache.glob("scale-*-pool3")) == [
        "scale-10-pool3",
        "scale-20-pool3",
    ]
