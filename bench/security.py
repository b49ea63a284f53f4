"""What encryption at rest costs (issue 26, item 6), and Redis over TLS when bench/redis_tls.py
is there.

  seal           AES-256-GCM seal + open of chunk-sized values (one stored KV chunk of the default
                 model in the served dtype: chunk_tokens x layers x K,V x kv heads x head dim,
                 codec-encoded) on one core (the seal runs on the calling thread)
                   seal_gbps             value bytes / (seal time + open time): a value's round
                                         trip, as a write then a later read pays it
                   seal_only_gbps, open_only_gbps   each half alone
  ttft           the real default model behind the real engine (bench/store_io.py's Rig), KV
                 on LMDB only (DRAM tier 0, no device prefix cache), so every later turn
                 restores its history from LMDB chunks: sealed ones with encryption on,
                 clear ones with it off; runs ordered on, off, off, on in one process
                   encrypt_ttft_ratio    mean later-turn TTFT, on / off (goal <= 1.03)
  redis_tls      bench/redis_tls.py's measure_redis_tls_ratio() (Redis TLS vs plain chunk
                 put/get GB/s), when that file exists; otherwise the key is left out

The last stdout line is one JSON object with those keys, the CPU model, its avx512_bf16 flag
and the compute dtype. `--quick` runs the smallest sizes (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import progress  # noqa: E402
from bench.machine import cpu_model  # noqa: E402
from bench.store_io import Rig, words  # noqa: E402
from chatstore.config import cpu_has_fast_bf16, load_config  # noqa: E402
from chatstore.store.sealing import KV_PURPOSE, Keyring, Sealer  # noqa: E402
from chatstore.store.sealing.master_key import Secret, new_secret_line  # noqa: E402
from chatstore.store.session_kv import SessionKV  # noqa: E402
from chatstore.store.tiers import codec  # noqa: E402


def chunk_value(spec, dtype: torch.dtype, chunk_tokens: int) -> bytearray:
    """One stored chunk of the model, encoded as the tiers store it before sealing."""
    shape = (spec.num_layers, 2, chunk_tokens, spec.num_kv_heads, spec.head_dim)
    kv = torch.randn(shape, dtype=torch.float32).to(dtype)
    return codec.encode(SessionKV(list(range(chunk_tokens)), kv), "bench")


def seal_speed(value: bytearray, seconds: float) -> dict:
    """Seal and open `value` repeatedly on this thread for about `seconds`."""
    sealer = Sealer(Keyring([Secret("k1", bytes(range(32)))]))
    key = b"0" * 32
    sealed = sealer.seal(KV_PURPOSE, "tenant", key, value)  # warm: key derivation cached
    seal_s = open_s = 0.0
    n = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or n < 3:
        t0 = time.perf_counter()
        sealed = sealer.seal(KV_PURPOSE, "tenant", key, value)
        t1 = time.perf_counter()
        opened = sealer.open(KV_PURPOSE, "tenant", key, sealed)
        t2 = time.perf_counter()
        seal_s += t1 - t0
        open_s += t2 - t1
        n += 1
    assert bytes(opened) == bytes(value)
    gb = len(value) * n / 1e9
    return {
        "seal_gbps": round(gb / (seal_s + open_s), 3),
        "seal_only_gbps": round(gb / seal_s, 3),
        "open_only_gbps": round(gb / open_s, 3),
        "chunk_bytes": len(value),
        "seal_iterations": n,
    }


def later_turn_ttfts(args, encrypt: bool, data_dir: str) -> list[float]:
    """TTFT of every session's later turns, each restored from LMDB (no DRAM tier, no device
    prefix cache: the history's KV can only come from the LMDB chunks)."""
    rig = Rig(
        data_dir,
        encrypt_at_rest=encrypt,
        secret_key=BENCH_SECRET,  # given: the bench never generates one in the user's home
        dram_bytes=0,
        enable_prefix_cache=False,
        persist="write_through",
    )
    tok, later, stored = rig.tok, [], 0
    label = f"encryption {'on' if encrypt else 'off'}"
    with progress.progress_bar(args.sessions * args.turns, label) as done:
        for i in range(args.sessions):
            ids = tok.encode(words(700 * i, args.words))
            for t in range(args.turns):
                res = rig.turn_ids(f"s{i}", ids, 8)
                if t:
                    # The whole previous history (bar a token at the join) came from LMDB.
                    assert res.cached_tokens >= stored - 2, f"{res.cached_tokens} of {stored}"
                    later.append(res.ttft_s)
                stored = len(ids) + len(res.reply)
                ids = ids + res.reply + tok.encode(" " + words(700 * i + 97 * t, 40))
                done.update(1)
    rig.close()
    return later


def redis_tls() -> dict:
    path = ROOT / "bench" / "redis_tls.py"
    if not path.exists():
        print("note: bench/redis_tls.py is not there: redis_tls_ratio left out", flush=True)
        return {}
    module = importlib.import_module("bench.redis_tls")
    measure = module.measure_redis_tls_ratio
    kwargs = {"quick": ARGS.quick} if "quick" in inspect.signature(measure).parameters else {}
    measured = measure(**kwargs)
    if isinstance(measured, dict):  # the ratio on top, its parts beside it (own chunk size)
        return {"redis_tls_ratio": measured["redis_tls_ratio"], "redis_tls": measured}
    return {"redis_tls_ratio": round(float(measured), 3)}


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smallest sizes (a smoke test)")
    p.add_argument("--only", default="seal,ttft,redis_tls")
    progress.add_argument(p)
    args = ARGS = p.parse_args()
    progress.configure(args)
    args.sessions, args.turns, args.words = (2, 2, 120) if args.quick else (6, 4, 1500)
    only = set(args.only.split(","))
    config = load_config(env={})
    result: dict = {
        "bench": "security",
        "cpu_model": cpu_model(),
        "avx512_bf16": cpu_has_fast_bf16(),
        "dtype": config.resolved_dtype,
    }
    if "seal" in only:
        from chatstore.model.default_model import gguf_path
        from chatstore.model.gguf_source import GGUFWeightSource

        spec = GGUFWeightSource(gguf_path()).spec
        value = chunk_value(spec, config.torch_dtype, config.chunk_tokens)
        result |= seal_speed(value, 0.5 if args.quick else 5.0)
        print(f"seal+open of {len(value)} B chunks: {result['seal_gbps']} GB/s", flush=True)
    if "ttft" in only:
        with tempfile.TemporaryDirectory() as tmp:
            runs: dict[bool, list[float]] = {True: [], False: []}
            for n, encrypt in enumerate((True, False, False, True)):
                runs[encrypt] += later_turn_ttfts(args, encrypt, f"{tmp}/run{n}")
        on, off = statistics.mean(runs[True]), statistics.mean(runs[False])
        result |= {
            "encrypt_ttft_ratio": round(on / off, 3),
            "ttft_on_s": round(on, 4),
            "ttft_off_s": round(off, 4),
            "ttft_turns": len(runs[True]),
        }
        print(f"later-turn TTFT from LMDB: on {on:.4f} s, off {off:.4f} s", flush=True)
    if "redis_tls" in only:
        result |= redis_tls()
    print(json.dumps(result))


ARGS: argparse.Namespace
BENCH_SECRET = new_secret_line("bench")


if __name__ == "__main__":
    main()
