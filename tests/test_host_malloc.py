"""host_malloc: with the mmap threshold pinned, large freed buffers leave the process (RSS)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from chatstore.host_malloc import pin_mmap_threshold

# A child process: one 24 MiB buffer freed (glibc's dynamic threshold rises to 24 MiB), then 40
# buffers of 6 MiB allocated and written, each followed by a small block that stays live (as a
# step's small tensors do), and the large ones freed; prints the RSS growth in MiB.
CHILD = textwrap.dedent(
    """
    import ctypes, sys
    from chatstore.host_malloc import pin_mmap_threshold
    if sys.argv[1] == "pin":
        assert pin_mmap_threshold() == 4 << 20
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def rss_mib():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    def touched(n):
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        return p
    base = rss_mib()
    libc.free(touched(24 << 20))
    bufs, kept = [], []
    for _ in range(40):
        bufs.append(touched(6 << 20))
        kept.append(touched(1024))  # a live small block above each: the heap cannot shrink
    for p in bufs:
        libc.free(p)
    print(round(rss_mib() - base))
    """
)


def _rss_growth_mib(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_buffers_leave_the_process_once_pinned() -> None:
    # glibc's default keeps the 240 MiB of freed 6 MiB buffers in the heap (the threshold rose
    # to 24 MiB with the first free); pinned at 4 MiB each one was its own mapping, unmapped.
    assert _rss_growth_mib("default") > 200
    assert _rss_growth_mib("pin") < 40


def test_the_environment_tunable_wins() -> None:
    assert pin_mmap_threshold(environ={"MALLOC_MMAP_THRESHOLD_": "65536"}) is None
