"""Fixtures shared by several test folders: the real default model, Redis servers (one shared,
one a test may break), one compute thread, the default model's recomputed conversation. Helpers
a test calls live in tests/support/; a fixture used by one folder only lives in its conftest."""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import ctypes.util
import gc
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

# Every server a test starts, in process or as a child process (`chatstore serve`, `chat
# --local`, the chaos and replica harnesses), computes in float32, whatever `dtype = auto` picks
# on this CPU: no test depends on the machine's CPU kind. tests/engine/test_dtype_by_cpu.py runs
# auto under both /proc/cpuinfo answers; the bf16 tests ask for bf16 by name. A developer may
# still run the suite's servers in bf16 with CHATSTORE_DTYPE=bfloat16.
TEST_DTYPE = "float32"
os.environ.setdefault("CHATSTORE_DTYPE", TEST_DTYPE)

# The master key (encryption at rest) of every server the tests start, in process or as a child
# process, is $XDG_CONFIG_HOME/chatstore/secret.key: here a directory of this run's own, made
# before any server starts and holding one key, so no test writes into the real home and replicas
# started without a secret of their own share this one (store/sealing/master_key.py). Tests of
# the key's generation and refusals point XDG_CONFIG_HOME elsewhere themselves.
_TEST_CONFIG_HOME = tempfile.mkdtemp(prefix="chatstore-test-config-")
atexit.register(shutil.rmtree, _TEST_CONFIG_HOME, True)
os.environ["XDG_CONFIG_HOME"] = _TEST_CONFIG_HOME
_key_dir = os.path.join(_TEST_CONFIG_HOME, "chatstore")
os.makedirs(_key_dir, mode=0o700)
with open(os.open(os.path.join(_key_dir, "secret.key"), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write("k1:" + base64.b64encode(os.urandom(32)).decode() + "\n")


@pytest.fixture(scope="module", autouse=True)
def give_freed_memory_back() -> Iterator[None]:
    """After each module, hand the memory its servers freed back to the OS. A server keeps
    freed activations in the heap for reuse (engine/host_memory.py), which is right for one
    long-lived server but, in a process that builds dozens of them one after another, left
    the suite's RSS growing by ~0.9 GB a module (13 GB by the end) with nothing alive."""
    yield
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(libc).malloc_trim(0)


@pytest.fixture(scope="session")
def default_model():
    """The real embedded SmolLM2-135M-Instruct (converted once into CHATSTORE_HOME)."""
    from chatstore.model import load_model

    return load_model()


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free loopback port, shared by the run's tests."""
    from tests.support.redis_server import start_local_redis

    server = start_local_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server, redis_client) -> str:
    """The shared server's URL, emptied first (redis_client flushed it)."""
    return redis_server.url


@pytest.fixture
def redis_client(redis_server):
    """A client of the shared server, emptied first."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def own_redis():
    """A redis-server of the test's own, which it may hang or kill (support/redis_faults.py)."""
    from tests.support.redis_faults import own_server

    yield from own_server()


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (and a busy machine makes 2 threads pathological).
    Modules of tiny-engine tests ask for it with `pytestmark = pytest.mark.usefixtures(...)`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(default_model):
    """The default model's conversation with every turn recomputed from scratch (the RE
    baseline of the multi-turn restore and encryption-at-rest tests)."""
    from tests.support.multiturn import recompute_conversation

    return recompute_conversation(default_model)


def pytest_terminal_summary(terminalreporter) -> None:
    """Which builds of the native kernels this run exercised (every variant the CPU runs): the
    last lines of `make test`, also under -q."""
    from chatstore.kernels import native

    ran = ", ".join(v.name for v in native.runnable_variants())
    terminalreporter.write_line(
        f"native kernel variants tested: {ran} (serving: {native.selected_variant().name})"
    )
