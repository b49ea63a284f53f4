"""Multi-turn chat with the session KV store on (CA) vs off (RE: recompute history every turn).

A deterministic ShareGPT-shaped workload (CachedAttention §4): sessions arrive as a Poisson
process; 27% are single-turn, the rest draw 2 + Poisson(5.5) turns (overall mean ~5.75, capped
by --max-turns); each user message is 20-120 words of English (from the text shipped with the
tests); each reply is a fixed number of greedy tokens, and the real reply is appended to the
history, which is re-rendered with the model's chat template every turn. Between turns a session
"thinks" for an exponential time. The same workload runs twice in one go through the real
AsyncEngine and the default model: once with the store (CA), once without (RE).

Measured per turn: TTFT (submit -> first token, queueing included), prompt tokens, cached tokens.
  ttft_reduction_pct        1 - mean TTFT(CA, turns >= 2) / mean TTFT(RE, turns >= 2)
  prefill_throughput_ratio  (prompt tokens / sum of TTFT) of CA over the same for RE
  hit_rate                  share of turns >= 2 whose history KV came from the store
The device prefix cache is off in both runs, so every reuse is the store's (as in the paper).

    python bench/multiturn.py [--sessions 16] [--tier dram|ssd|redis] [--read-buffer-layers -1]
                              [--quick] [--plot-dir bench/out] [--no-progress]

Writes <plot dir>/multiturn_ttft_by_turn.png: mean TTFT by turn index, store on (CA) vs off (RE).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import plots, progress  # noqa: E402
from chatstore.config import load_config  # noqa: E402
from chatstore.engine.async_engine import AsyncEngine  # noqa: E402
from chatstore.engine.engine_config import EngineConfig  # noqa: E402
from chatstore.engine.request import Request, SamplingParams  # noqa: E402
from chatstore.engine.runtime import create_runtime  # noqa: E402
from chatstore.store.attention_store import create_store  # noqa: E402
from chatstore.transfer import create_connector  # noqa: E402

TEXT = ROOT / "tests" / "data" / "declaration_and_lincoln.txt"
SYSTEM = "You are a helpful assistant. Answer briefly."


@dataclass
class SessionPlan:
    arrival_s: float
    messages: list[str]  # user messages, one per turn
    think_s: list[float]


@dataclass
class TurnResult:
    session: int
    turn: int  # 1-based
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class RunResult:
    turns: list[TurnResult] = field(default_factory=list)
    store: dict | None = None
    wall_s: float = 0.0


def make_workload(args: argparse.Namespace) -> list[SessionPlan]:
    rng = random.Random(args.seed)
    words = TEXT.read_text().split()
    plans, t = [], 0.0
    for _ in range(args.sessions):
        t += rng.expovariate(args.arrival_rate)
        n = 1 if rng.random() < 0.27 else 2 + _poisson(rng, 5.5)
        n = min(n, args.max_turns)
        messages = []
        for _ in range(n):
            count = rng.randint(20, 120)
            start = rng.randrange(0, len(words) - count)
            messages.append(" ".join(words[start : start + count]))
        think = [rng.expovariate(1.0 / args.think_s) for _ in range(n)]
        plans.append(SessionPlan(t, messages, think))
    return plans


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth's method: fine for small lambda, and deterministic given rng.
    threshold, k, p = pow(2.718281828459045, -lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= threshold:
            return k
        k += 1


async def run_session(
    engine: AsyncEngine,
    idx: int,
    plan: SessionPlan,
    mode: str,
    args,
    t0: float,
    out: RunResult,
    on_turn: Callable[[], object],
    store: Any = None,
) -> None:
    tok = engine.tokenizer
    await asyncio.sleep(max(0.0, t0 + plan.arrival_s - time.monotonic()))
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, (text, think) in enumerate(zip(plan.messages, plan.think_s, strict=True), 1):
        messages.append({"role": "user", "content": text})
        rendered = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        ids = list(rendered["input_ids"])
        sampling = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)
        request = Request(f"{mode}-{idx}-{turn}", ids, sampling, session_id=f"s{idx}")
        if store is not None:  # the API opens the turn: SSD / Redis chunks come up to host memory
            opening = asyncio.to_thread(store.open_turn, request.tenant, f"s{idx}")
            request.store_turn = await opening
        reply: list[int] = []
        first = usage = None
        async for o in engine.submit(request):
            first = first or o.first_token_time
            reply += [t for s in o.samples for t in s.token_ids]
            usage = o.usage or usage
        out.turns.append(
            TurnResult(idx, turn, first - request.arrival_time, len(ids), usage.cached_tokens)
        )
        messages.append(
            {"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)}
        )
        on_turn()
        await asyncio.sleep(think)


async def run(mode: str, args, runtime, plans: list[SessionPlan], redis_url: str) -> RunResult:
    sizes = {"dram": (1 << 30, 0, ""), "ssd": (0, 8 << 30, ""), "redis": (0, 0, redis_url)}
    dram, ssd, url = sizes[args.tier]
    result = RunResult()
    with tempfile.TemporaryDirectory() as data_dir:
        overrides = {"data_dir": data_dir, "dram_bytes": dram, "ssd_bytes": ssd}
        overrides |= {"redis_url": url, "kv_store": "on" if mode == "CA" else "off"}
        config = load_config(overrides=overrides)
        store = create_store(config, runtime.model.spec, runtime.model.fingerprint)
        overrides = {"read_buffer_layers": args.read_buffer_layers}
        conn = create_connector(store, runtime.kv_cache, runtime.runner.rope, **overrides)
        engine = AsyncEngine(runtime, EngineConfig(enable_prefix_cache=False), conn)
        engine.start()
        t0 = time.monotonic()
        turns = sum(len(p.messages) for p in plans)
        try:
            with progress.progress_bar(turns, f"multiturn {mode} turns") as bar:
                await asyncio.gather(
                    *(
                        run_session(engine, i, p, mode, args, t0, result, bar.update, store)
                        for i, p in enumerate(plans)
                    )
                )
        finally:
            await engine.shutdown()
        result.wall_s = time.monotonic() - t0
        if store is not None:
            result.store = store.stats().as_dict()
            store.close()
    return result


def summarize(res: RunResult) -> dict:
    later = [t for t in res.turns if t.turn >= 2]
    by_turn: dict[int, list[float]] = {}
    for t in res.turns:
        by_turn.setdefault(t.turn, []).append(t.ttft_s)
    return {
        "ttft_by_turn_s": {k: round(statistics.mean(v), 4) for k, v in sorted(by_turn.items())},
        "mean_ttft_later_s": statistics.mean(t.ttft_s for t in later),
        "prefill_tok_per_s": sum(t.prompt_tokens for t in res.turns)
        / sum(t.ttft_s for t in res.turns),
        "hit_rate": sum(t.cached_tokens > 0 for t in later) / max(1, len(later)),
        "prompt_tokens": sum(t.prompt_tokens for t in res.turns),
        "cached_tokens": sum(t.cached_tokens for t in res.turns),
        "turns": len(res.turns),
        "wall_s": round(res.wall_s, 1),
    }


def plot_ttft_by_turn(plot_dir: Path, arms: dict[str, dict], tier: str) -> Path:
    """Mean TTFT per turn index, one line per arm (summaries from `summarize`)."""
    names = {"RE": "store off (RE: recompute the history)", "CA": f"store on (CA, {tier} tier)"}
    series = [
        plots.Series(
            names.get(arm, arm), list(s["ttft_by_turn_s"]), list(s["ttft_by_turn_s"].values())
        )
        for arm, s in arms.items()
    ]
    return plots.line_chart(
        plots.plot_path(plot_dir, "multiturn", "ttft_by_turn"),
        series,
        title="multiturn: mean time to first token by turn",
        xlabel="turn index (1 = the session's first turn)",
        ylabel="mean TTFT, s",
        integer_x=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--arrival-rate", type=float, default=0.5, help="sessions per second")
    p.add_argument("--think-s", type=float, default=1.0, help="mean think time between turns")
    p.add_argument("--max-turns", type=int, default=12)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--tier", choices=["dram", "ssd", "redis"], default="dram")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--read-buffer-layers", type=int, default=-1, help="-1 = all layers (the default), 0 off"
    )
    p.add_argument("--quick", action="store_true", help="6 sessions of at most 5 turns")
    plots.add_argument(p)
    progress.add_argument(p)
    args = p.parse_args()
    progress.configure(args)
    if args.quick:
        args.sessions, args.max_turns = 6, 5
    runtime = create_runtime(load_config())
    plans = make_workload(args)
    server = None
    if args.tier == "redis":
        from tests.support.redis_server import start_local_redis

        server = start_local_redis()
    try:
        url = server.url if server else ""
        results = {m: asyncio.run(run(m, args, runtime, plans, url)) for m in ("RE", "CA")}
    finally:
        if server:
            server.stop()
    re_s, ca_s = summarize(results["RE"]), summarize(results["CA"])
    print(f"{len(plans)} sessions, {re_s['turns']} turns, tier {args.tier}")
    print(f"{'turn':>4}  {'RE TTFT s':>10}  {'CA TTFT s':>10}")
    for k in re_s["ttft_by_turn_s"]:
        print(f"{k:>4}  {re_s['ttft_by_turn_s'][k]:>10.3f}  {ca_s['ttft_by_turn_s'][k]:>10.3f}")
    for name, s in (("RE", re_s), ("CA", ca_s)):
        print(
            f"{name}: mean TTFT turns>=2 {s['mean_ttft_later_s']:.3f} s, prefill "
            f"{s['prefill_tok_per_s']:.0f} tok/s, hit rate {s['hit_rate']:.2f}, "
            f"cached {s['cached_tokens']}/{s['prompt_tokens']} prompt tokens, wall {s['wall_s']} s"
        )
    tiers = results["CA"].store["tiers"] if results["CA"].store else []
    reads = sum(t["hits"] for t in tiers)  # chunk reads served, over all tiers
    hit_by_tier = {t["name"]: round(t["hits"] / max(1, reads), 3) for t in tiers}
    print("CA chunk reads per tier (share of all reads):", hit_by_tier)
    plot_ttft_by_turn(args.plot_dir, {"RE": re_s, "CA": ca_s}, args.tier)
    summary = {
        "bench": "multiturn",
        "tier": args.tier,
        "read_buffer_layers": args.read_buffer_layers,
        "sessions": len(plans),
        "turns": re_s["turns"],
        "ttft_reduction_pct": round(
            100 * (1 - ca_s["mean_ttft_later_s"] / re_s["mean_ttft_later_s"]), 1
        ),
        "prefill_throughput_ratio": round(ca_s["prefill_tok_per_s"] / re_s["prefill_tok_per_s"], 2),
        "hit_rate": round(ca_s["hit_rate"], 3),
        "hit_rate_by_tier": hit_by_tier,
        "re_mean_ttft_later_s": round(re_s["mean_ttft_later_s"], 4),
        "ca_mean_ttft_later_s": round(ca_s["mean_ttft_later_s"], 4),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
