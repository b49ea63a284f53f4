"""What saving each turn's KV costs the engine: no store vs synchronous vs asynchronous save.

Through the real LLMEngine and the default model, one request at a time (a new session each, so
nothing is reused: only the save is measured): prompts of 1,000-1,600 tokens, 20 greedy decode
steps each. Three configurations over the same prompts, interleaved over --rounds rounds (the
fastest round of each counts):

    none    kv_store = off (NullConnector): the baseline
    sync    the finished turn's KV is assembled and written to the tiers on the engine thread
    async   the engine thread hands it to the store's writer thread (write buffer) and goes on

Saves land in the DRAM tier (default size). With --dram-sessions N the DRAM tier holds only N
sessions, so in steady state each save also demotes one session to LMDB (a store that has filled
up: much more work per save). Printed last, as one JSON line:
    ms_per_request_{none,sync,async}, sync_save_overhead_pct, async_save_overhead_pct
    (time per request vs none), async_flush_ms (writes still pending when the engine went idle).

With --concurrent all requests run together (a decode batch of --requests sessions): what the
per-layer write stream costs a batched decode step.

    python bench/save.py [--requests 6] [--rounds 3] [--dram-sessions N] [--quick]
                         [--concurrent] [--decode-steps 20] [--plot-dir bench/out] [--no-progress]

Writes <plot dir>/save_ms_per_request.png: time per request of each configuration, every round.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import plots, progress  # noqa: E402
from chatstore.config import Config, load_config  # noqa: E402
from chatstore.engine.engine_config import EngineConfig  # noqa: E402
from chatstore.engine.llm_engine import LLMEngine  # noqa: E402
from chatstore.engine.request import Request, SamplingParams  # noqa: E402
from chatstore.engine.runtime import Runtime, create_runtime  # noqa: E402
from chatstore.store.attention_store import create_store  # noqa: E402
from chatstore.transfer import StoreConnector  # noqa: E402

DECODE_STEPS = 20


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(
    runtime: Runtime,
    config: Config,
    mode: str,
    batch: list[list[int]],
    tag: str,
    concurrent: bool = False,
    decode_steps: int = DECODE_STEPS,
) -> tuple[float, float]:
    """(seconds per request with the engine busy, seconds to flush pending writes after)."""
    store = None
    connector = None
    if mode != "none":
        overrides = {"async_save": mode == "async"}
        store = create_store(
            Config(**{**config.__dict__, **overrides}),
            runtime.model.spec,
            runtime.model.fingerprint,
        )
        assert store is not None
        connector = StoreConnector(store, runtime.kv_cache, runtime.runner.rope)
    engine = LLMEngine(runtime, EngineConfig.from_config(config), connector)
    sampling = SamplingParams(max_tokens=decode_steps, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(batch):
        engine.add_request(Request(f"{tag}-{i}", ids, sampling, session_id=f"{tag}-{i}"))
        while engine.has_work() and not (concurrent and i < len(batch) - 1):
            engine.step()
    busy = time.perf_counter() - start
    flush = 0.0
    if store is not None:
        t0 = time.perf_counter()
        store.flush_writes()
        flush = time.perf_counter() - t0
        assert store.writer.failures == 0
        store.close(flush_dram=False)
    return busy / len(batch), flush


def plot_rounds(plot_dir: Path, rounds: dict[str, list[float]], args) -> Path:
    """ms per request of each configuration, a group of bars per round."""
    names = {"none": "no store", "sync": "synchronous save", "async": "asynchronous save"}
    n = len(rounds["none"])
    batch = "concurrent" if args.concurrent else "one at a time"
    return plots.bar_chart(
        plots.plot_path(plot_dir, "save", "ms_per_request"),
        [
            plots.Bars(
                "", [f"round {r + 1}" for r in range(n)], {names[m]: v for m, v in rounds.items()}
            )
        ],
        title=f"save: time per request, {args.requests} requests ({batch}), "
        f"{args.min_tokens}-{args.max_tokens} prompt tokens + {args.decode_steps} decode steps",
        ylabel="ms per request",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=1600)
    parser.add_argument("--dram-sessions", type=int, default=0, help="0 = config default")
    parser.add_argument("--quick", action="store_true", help="3 requests, 1 round")
    parser.add_argument("--concurrent", action="store_true", help="all requests in one batch")
    parser.add_argument("--decode-steps", type=int, default=DECODE_STEPS)
    plots.add_argument(parser)
    progress.add_argument(parser)
    args = parser.parse_args()
    progress.configure(args)
    if args.quick:
        args.requests, args.rounds = 3, 1
    data = Path(tempfile.mkdtemp(prefix="chatstore-bench-save-"))
    per_session = args.max_tokens * 2 * 30 * 3 * 64 * 4  # fp32 KV of the longest prompt
    overrides: dict[str, object] = {
        "data_dir": str(data),
        "enable_prefix_cache": False,
        "ssd_bytes": 8 << 30,
    }
    if args.dram_sessions > 0:
        overrides["dram_bytes"] = args.dram_sessions * per_session
    config = load_config(overrides=overrides)
    runtime = create_runtime(config)
    vocab = runtime.model.spec.vocab_size
    batch = prompts(args.requests, args.min_tokens, args.max_tokens, vocab)
    run(runtime, config, "none", prompts(1, 200, 200, vocab, seed=1), "warmup")
    best: dict[str, float] = {}
    rounds: dict[str, list[float]] = {"none": [], "sync": [], "async": []}  # ms per request
    flush_s = 0.0
    runs = [(r, mode) for r in range(args.rounds) for mode in rounds]
    for r, mode in progress.track(runs, "save runs"):
        per_request, flush = run(
            runtime,
            config,
            mode,
            batch,
            f"r{r}-{mode}",
            args.concurrent,
            args.decode_steps,
        )
        print(f"round {r} {mode:5s} {per_request * 1000:9.1f} ms/request", file=sys.stderr)
        best[mode] = min(best.get(mode, float("inf")), per_request)
        rounds[mode].append(per_request * 1000)
        if mode == "async":
            flush_s = max(flush_s, flush)

    plot_rounds(args.plot_dir, rounds, args)

    def overhead(mode: str) -> float:
        return round(100 * (best[mode] / best["none"] - 1), 2)

    result = {
        "requests": args.requests,
        "rounds": args.rounds,
        "prompt_tokens": [args.min_tokens, args.max_tokens],
        "decode_steps": args.decode_steps,
        "concurrent": args.concurrent,
        "dram_bytes": config.dram_bytes,
        **{f"ms_per_request_{m}": round(best[m] * 1000, 1) for m in ("none", "sync", "async")},
        "async_flush_ms": round(flush_s * 1000, 1),
        "sync_save_overhead_pct": overhead("sync"),
        "async_save_overhead_pct": overhead("async"),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
