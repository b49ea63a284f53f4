"""Load time and peak RSS of the default model, to the first token (issue 35 item 1).

Each measurement runs in a fresh process (`python bench/model_load.py --one`): the import of
chatstore, `create_runtime` with the default config (`weights = auto`, `dtype = auto`: what
`chatstore serve` builds), and one greedy token; peak RSS is the process's ru_maxrss, steady RSS
what /proc/self/statm says after the token, cpu_s the process's user + system time to then (less
sensitive than the wall clock to other work on a shared machine). Medians of the runs. The
converted tokenizer cache is warm (the first start of a machine converts it once; not measured
here). Last line: one JSON object.

The server's readiness (issue 35: ready <= 2 s): `chatstore serve` from its spawn to the first
200 from /healthz, with the tokenizer chatstore reads itself (fast_tokenizer.py) and with
transformers' (CHATSTORE_TOKENIZER=transformers), alternately, each in a fresh process with its
bytecode cache written (the first start of each writes it and is not counted).

    python bench/model_load.py [--runs 3] [--kv-bytes 67108864] [--serve-runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def one(kv_bytes: int) -> dict[str, float]:
    start = time.perf_counter()
    import torch

    from chatstore.config import Config
    from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
    from chatstore.engine.runtime import create_runtime

    imported = time.perf_counter()
    runtime = create_runtime(Config(kv_cache_bytes=kv_bytes, kv_store="off"))
    loaded = time.perf_counter()
    ids = runtime.model.tokenizer.encode("Hello there", add_special_tokens=False)
    blocks = runtime.pool.allocate(-(-len(ids) // runtime.block_size))
    chunk = SequenceChunk(ids, 0, blocks)
    batch = ForwardBatch.build([chunk], runtime.block_size)
    logits = runtime.runner.forward(batch)
    token = int(torch.argmax(logits[-1]))
    first = time.perf_counter()
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        steady = int(f.read().split()[1]) * page
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak = usage.ru_maxrss * 1024
    return {
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "import_s": imported - start,
        "load_s": loaded - imported,
        "first_token_s": first - start,
        "peak_rss_mb": peak / 2**20,
        "steady_rss_mb": steady / 2**20,
        "token": token,
        "dtype": str(runtime.runner.dtype).removeprefix("torch."),
    }


def serve_ready_s(tokenizer: str) -> float:
    """Seconds from spawning `chatstore serve` (a new data dir, a free port) to /healthz 200."""
    import tempfile
    import urllib.request

    from peer_servers import free_port  # here, not at the top: `--one` times imports

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        secret = os.path.join(tmp, "secret.key")
        with open(secret, "w") as f:
            f.write("k1:" + "A" * 43 + "=\n")
        os.chmod(secret, 0o600)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["CHATSTORE_TOKENIZER"] = tokenizer
        cmd = [sys.executable, "-m", "chatstore.cli", "serve", "--port", str(port),
               "--data-dir", os.path.join(tmp, "data"), "--secret-file", secret,
               "--log-level", "warning"]  # fmt: skip
        start = time.perf_counter()
        server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"chatstore serve exited: {server.stderr.read()!r}")
                try:
                    url = f"http://127.0.0.1:{port}/healthz"
                    with urllib.request.urlopen(url, timeout=1) as r:
                        if r.status == 200:
                            return time.perf_counter() - start
                except OSError:
                    time.sleep(0.01)
                if time.perf_counter() - start > 120:
                    raise RuntimeError("chatstore serve was not ready in 120 s")
        finally:
            server.terminate()
            server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kv-bytes", type=int, default=64 << 20)
    parser.add_argument("--one", action="store_true", help="one measurement, in this process")
    parser.add_argument("--serve-runs", type=int, default=5, help="server starts per tokenizer")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.kv_bytes)))
        return
    runs = []
    for _ in range(args.runs):
        cmd = [sys.executable, __file__, "--one", "--kv-bytes", str(args.kv_bytes)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(runs[-1], file=sys.stderr)
    summary: dict[str, object] = {
        k: statistics.median(r[k] for r in runs)
        for k in ("import_s", "load_s", "first_token_s", "cpu_s", "peak_rss_mb", "steady_rss_mb")
    }
    summary["runs"] = len(runs)
    summary["dtype"] = runs[0]["dtype"]
    if args.serve_runs:
        ready: dict[str, list[float]] = {"auto": [], "transformers": []}
        for choice in ready:
            serve_ready_s(choice)  # writes the bytecode cache; not counted
        for _ in range(args.serve_runs):
            for choice, times in ready.items():
                times.append(serve_ready_s(choice))
        for choice, times in ready.items():
            print(
                f"serve ready, {choice} tokenizer: {[round(t, 3) for t in times]}", file=sys.stderr
            )
        summary["serve_ready_s"] = round(statistics.median(ready["auto"]), 3)
        summary["serve_ready_s_transformers_tokenizer"] = round(
            statistics.median(ready["transformers"]), 3
        )
        summary["serve_ready_ratio"] = round(
            summary["serve_ready_s"] / summary["serve_ready_s_transformers_tokenizer"], 3
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
