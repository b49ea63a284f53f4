"""What TLS to Redis costs: KV chunk put/get GB/s through our RedisTier, TLS vs plain.

Two redis-servers on loopback, started here: one plain, one TLS-only with client certificates
and the ACL user of deploy/redis-users.acl.template (tests/support/redis_tls.py makes its
certificates). Each is driven the way the store drives Redis: RedisTier.put_many / get_many of
chunk-sized values (one chunk of the default model: 256 tokens x 30 layers x K,V x 3 KV heads x
64 dims in bf16, ~5.9 MB encoded), `batch` chunks per pipeline, fresh keys each round (the tier
skips a chunk it already holds), deleted after; plain and TLS taken in turn, in warmed blocks of
rounds in ABBA order, so drift on the machine slows both alike. The encode / decode (codec.py:
header, CRC) is inside the timed calls, as it is in the server, and costs the same on both;
`raw_*` keys time the same pipelines of the encoded bytes alone (connect_redis, SET / GET), the
transport only.

    redis_tls_ratio      TLS GB/s / plain GB/s through RedisTier, puts and gets together
                         (issue 26 goal: >= 0.7)
    redis_plain_gbps     (bytes put + bytes got) / (put time + get time), plain
    redis_tls_gbps       the same over TLS
    *_put_gbps, *_get_gbps, raw_*   the parts

Encryption at rest is off here (RedisTier without a sealer): sealing costs the same with or
without TLS and bench/security.py measures it. Loopback has no network cost, so this is the CPU
cost of TLS (AES-GCM in OpenSSL on both ends, one Redis thread) at its most visible.

    python bench/redis_tls.py [--quick] [--rounds N] [--batch N]

Prints one line per measurement; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from chatstore.redis_security import RedisSecurity  # noqa: E402
from chatstore.store.session_kv import (  # noqa: E402
    ChunkKey,
    SessionKV,
)
from chatstore.store.tiers import codec  # noqa: E402
from chatstore.store.tiers.redis import RedisTier, connect_redis  # noqa: E402
from tests.support.redis_server import start_local_redis  # noqa: E402
from tests.support.redis_tls import make_tls_files, start_tls_redis  # noqa: E402

# One KV chunk of the default model (SmolLM2-135M-Instruct) at chunk_tokens = 256, in bf16.
LAYERS, KV_HEADS, HEAD_DIM, CHUNK_TOKENS = 30, 3, 64, 256
FINGERPRINT = "bench-redis-tls"


@dataclass
class Throughput:
    put_bytes: int = 0
    put_s: float = 0.0
    get_bytes: int = 0
    get_s: float = 0.0

    def gbps(self) -> float:
        return (self.put_bytes + self.get_bytes) / max(self.put_s + self.get_s, 1e-9) / 1e9

    def put_gbps(self) -> float:
        return self.put_bytes / max(self.put_s, 1e-9) / 1e9

    def get_gbps(self) -> float:
        return self.get_bytes / max(self.get_s, 1e-9) / 1e9


def chunk_value(tokens: int, seed: int) -> SessionKV:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((LAYERS, 2, tokens, KV_HEADS, HEAD_DIM), generator=g).to(torch.bfloat16)
    return SessionKV(list(range(tokens)), kv)


class TierRounds:
    """RedisTier put_many / get_many of all values, one round at a time, fresh keys each round."""

    def __init__(self, url: str, security: RedisSecurity | None, values: list[SessionKV]) -> None:
        self.tier = RedisTier(
            connect_redis(url, 30.0, security=security), 1 << 40, FINGERPRINT, ttl_s=600,
            timeout_s=30.0,
        )  # fmt: skip
        self.values = values
        self.size = len(codec.encode(values[0], FINGERPRINT))
        self.out = Throughput()

    def round(self, r: int, measured: bool) -> None:
        keys = [ChunkKey("bench", f"{r:08x}{i:024x}") for i in range(len(self.values))]
        started = time.perf_counter()
        self.tier.put_many(list(zip(keys, self.values, strict=True)))
        put_s = time.perf_counter() - started
        started = time.perf_counter()
        got = self.tier.get_many(keys)
        get_s = time.perf_counter() - started
        pairs = zip(got, self.values, strict=True)
        assert all(g is not None and g.kv.shape == v.kv.shape for g, v in pairs)
        for key in keys:
            self.tier.delete_shared(key)  # free Redis between rounds (delete only forgets)
        if measured:
            self.out.put_bytes += self.size * len(self.values)
            self.out.get_bytes += self.size * len(self.values)
            self.out.put_s += put_s
            self.out.get_s += get_s

    def close(self) -> None:
        self.tier.close()


class RawRounds:
    """The same pipelines of encoded bytes: SET / GET only, no codec."""

    def __init__(self, url: str, security: RedisSecurity | None, blobs: list[bytes]) -> None:
        self.client = connect_redis(url, 30.0, security=security)
        self.blobs = blobs
        self.names = [f"chatstore:bench:{i}" for i in range(len(blobs))]
        self.out = Throughput()

    def round(self, r: int, measured: bool) -> None:
        started = time.perf_counter()
        with self.client.pipeline(transaction=False) as pipe:
            for name, blob in zip(self.names, self.blobs, strict=True):
                pipe.set(name, blob, ex=600)
            pipe.execute()
        put_s = time.perf_counter() - started
        started = time.perf_counter()
        with self.client.pipeline(transaction=False) as pipe:
            for name in self.names:
                pipe.get(name)
            got = pipe.execute()
        get_s = time.perf_counter() - started
        assert [len(g) for g in got] == [len(b) for b in self.blobs]
        self.client.delete(*self.names)
        if measured:
            total = sum(len(b) for b in self.blobs)
            self.out.put_bytes += total
            self.out.get_bytes += total
            self.out.put_s += put_s
            self.out.get_s += get_s

    def close(self) -> None:
        self.client.close()


def interleaved(pair: dict[str, Any], rounds: int, block: int = 3) -> dict[str, Throughput]:
    """The plain and the TLS side taken in turn, in blocks of `block` measured rounds after one
    warm-up round (connections, TLS sessions, both ends' allocators), blocks in ABBA order.
    Taken one after the other, a machine whose speed drifts (other work, frequency) measured
    the drift as much as TLS (0.64 and 0.73 for the same code, minutes apart); taken round by
    round, each round found the other server's and the client's memory state, not its own,
    and plain lost a third of its speed. Blocks keep each side warm and cancel the drift."""
    names = list(pair)
    r = 0
    for b in range(-(-rounds // block)):
        for name in names if b % 2 == 0 else reversed(names):
            for i in range(block + 1):
                pair[name].round(r, measured=i > 0)
                r += 1
    return {name: side.out for name, side in pair.items()}


def measure_redis_tls_ratio(quick: bool = False, rounds: int = 0, batch: int = 0) -> dict[str, Any]:
    rounds = rounds or (2 if quick else 10)
    batch = batch or (2 if quick else 8)
    tokens = 32 if quick else CHUNK_TOKENS
    values = [chunk_value(tokens, seed) for seed in range(batch)]
    blobs = [bytes(codec.encode(v, FINGERPRINT)) for v in values]
    plain = start_local_redis()
    tls = start_tls_redis(make_tls_files(Path(tempfile.mkdtemp(prefix="chatstore-tls-"))))
    security = tls.security("chatstore")
    sides: list[Any] = []
    try:
        tiers = {"plain": TierRounds(plain.url, None, values)}
        tiers["tls"] = TierRounds(tls.url, security, values)
        sides += tiers.values()
        results = interleaved(tiers, rounds)
        raws = {"raw_plain": RawRounds(plain.url, None, blobs)}
        raws["raw_tls"] = RawRounds(tls.url, security, blobs)
        sides += raws.values()
        results |= interleaved(raws, rounds)
    finally:
        for side in sides:
            side.close()
        plain.stop()
        tls.stop()
    out: dict[str, Any] = {
        "redis_tls_ratio": round(results["tls"].gbps() / results["plain"].gbps(), 3),
        "redis_plain_gbps": round(results["plain"].gbps(), 3),
        "redis_tls_gbps": round(results["tls"].gbps(), 3),
    }
    for name, t in results.items():
        prefix = f"redis_{name}"
        out[f"{prefix}_put_gbps"] = round(t.put_gbps(), 3)
        out[f"{prefix}_get_gbps"] = round(t.get_gbps(), 3)
    out["redis_raw_tls_ratio"] = round(results["raw_tls"].gbps() / results["raw_plain"].gbps(), 3)
    measured = -(-rounds // 3) * 3  # whole blocks of interleaved()
    out.update(chunk_bytes=len(blobs[0]), batch=batch, rounds=measured, quick=quick)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small chunks, 2 rounds (a smoke run)")
    p.add_argument("--rounds", type=int, default=0, help="measured rounds (default 10)")
    p.add_argument("--batch", type=int, default=0, help="chunks per pipeline (default 8)")
    args = p.parse_args()
    result = measure_redis_tls_ratio(args.quick, args.rounds, args.batch)
    for key, value in result.items():
        print(f"{key:32s} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
