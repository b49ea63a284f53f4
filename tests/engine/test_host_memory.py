"""host_memory.keep_freed_memory: the mallopt arguments reach glibc as the values meant.

mallopt's value is a C int and ctypes wraps what does not fit without a word (the old trim
threshold, 2 << 30, arrived as -2**31), so each value must round-trip through c_int; the call
itself runs in a subprocess, which keeps the tuning out of the test process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys

import pytest

from chatstore.engine import host_memory

C_INT_MAX = 2**31 - 1


def test_every_mallopt_value_fits_a_c_int():
    values = dict(host_memory.MALLOPT_ARGS)
    assert values == {
        host_memory._M_MMAP_THRESHOLD: host_memory.MMAP_THRESHOLD,
        host_memory._M_TRIM_THRESHOLD: host_memory.TRIM_THRESHOLD,
    }
    for param, value in host_memory.MALLOPT_ARGS:
        assert 0 < value <= C_INT_MAX, (param, value)
        assert ctypes.c_int(value).value == value, (param, value)
        assert ctypes.c_int(param).value == param
    # What the check guards against: the old trim threshold wrapped to a negative int.
    assert ctypes.c_int(2 << 30).value == -(2**31)


CHILD = """
import ctypes, ctypes.util, json
from chatstore.engine import host_memory
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
libc.mallopt.restype = ctypes.c_int
each = [libc.mallopt(p, v) for p, v in host_memory.MALLOPT_ARGS]
print(json.dumps({"each": each, "keep": host_memory.keep_freed_memory()}))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
    reason="mallopt is glibc's",
)
def test_mallopt_accepts_each_value_in_a_fresh_process():
    env = {**os.environ, "CHATSTORE_MALLOC_TUNING": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"each": [1] * len(host_memory.MALLOPT_ARGS), "keep": True}


def test_tuning_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("CHATSTORE_MALLOC_TUNING", "0")
    host_memory.keep_freed_memory.cache_clear()
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        host_memory.keep_freed_memory.cache_clear()


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def test_zeros_on_demand_reads_zero_and_is_resident_only_where_written():
    """The CPU KV pool: zeros, shaped and typed as asked, writable; its pages come when a block
    is first written (a 256 MiB pool adds far less than that to RSS until then)."""
    import torch

    before = _rss_mb()
    pool = host_memory.zeros_on_demand((4, 2, 4096, 16, 8, 64), torch.bfloat16)  # 256 MiB
    assert pool.shape == (4, 2, 4096, 16, 8, 64) and pool.dtype == torch.bfloat16
    assert _rss_mb() - before < 64
    assert not pool[0, 0, 0].any()
    pool[1].fill_(1.5)  # a quarter of it written
    assert _rss_mb() - before >= 48
    assert pool[1].float().mean().item() == 1.5 and not pool[2].any()
    assert host_memory.zeros_on_demand((0, 3), torch.float32).shape == (0, 3)
