"""Engine speed against transformers eager in process; with --vllm, served against vLLM-CPU.

In process, side by side on the same model object and threads:

    prefill  tokens/s for one fresh prompt of 512, 1K, 2K tokens (logits of the last token only)
    history  ms for 100 new tokens on 1K, 4K, 8K tokens of history already in the pool, against
             our reference path (gather-and-mask SDPA, torch ops): the path history and mixed
             batches took before the paged-prefill kernel
    decode   tokens/s at batch 1, 8, 32, each sequence on 512 tokens of context, greedy
    KV waste allocated-but-unused slots / allocated slots on a mixed-length batch (block size 16),
             against a contiguous reservation of the maximum context per request

Transformers runs its own decode loop the way `generate` does inside: batched `model(...)` steps
over a DynamicCache (past_key_values), the next token the argmax of the last. Every number is the
median of a few timed repetitions after a warm-up. The in-process dtype is the one `chatstore
serve` runs by default (`dtype = "auto"` resolved for this machine) unless --dtype says otherwise;
the `*_ratio_*` keys are ours / transformers at that dtype.

With --vllm the same run also measures two servers over HTTP, one at a time on loopback, each
stopped before the next starts: ours is `chatstore serve` with its defaults, the peer vLLM's CPU
build (the scripts in --vllm-scripts: setup.sh makes its venv, serve.sh starts it). The peer runs
in every dtype of --vllm-dtypes, because which one is faster depends on the CPU (without
AVX512-BF16 or AMX its bf16 is emulated and slower than fp32); each metric compares us with the
peer's faster dtype for that metric, and the table names it. Definitions in peer_servers.py:

    prefill  one fresh ~2,000-token prompt: prompt tokens / TTFT
    decode   batch 1, 8, 32 streams of 128 tokens (EOS banned): Σ(tokens after each stream's
             first) / (last token of any stream - first token of the first); b=32 runs once
    history  100 new tokens on 1K / 4K / ~8K (7,900) tokens of history the server already holds:
             TTFT (vLLM: its prefix cache; ours: the session the history was sent in)
    together 8 fresh ~3,700-token prompts sent at the same moment (concurrent_prefill.py): mean
             TTFT, `concurrent_prefill_ttft_ratio` = ours / vLLM's faster dtype (<= 1 good)

Every `*_vs_vllm_*` key is a speed ratio, above 1 when we are faster (history: vLLM's TTFT / ours);
the raw numbers are `served_ours_*`, `vllm_*` (the faster dtype, named by `vllm_*_dtype`) and
`vllm_<dtype>_*`. --quick measures each served case once. A full --vllm run is estimated at
~12 minutes on 2 quiet cores, two vLLM starts (~1 min each) included; --prefill-tokens,
--decode-tokens, --decode-batches, --history-lens and --peer-reps shrink it for a trial. The last
line printed is one JSON object; it starts with the machine (CPU model, ISA, the kernel variant
serving, torch's vector width, threads: bench/machine.py).

    python bench/engine_speed.py [--quick] [--dtype float32|bfloat16] [--threads N]
                                 [--vllm [--vllm-dtypes bfloat16,float32]] [--no-progress]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from concurrent_prefill import (
    PROMPT_TOKENS,
    PROMPTS,
    ConcurrentPrefill,
    concurrent_prompts,
    measure_concurrent_prefill,
)
from peer_servers import (
    PromptMaker,
    ServedSpeed,
    Workload,
    chatstore_server,
    ensure_vllm,
    measure,
    stop_all_servers,
    vllm_server,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import progress
from bench.machine import describe, machine_report
from chatstore.engine.block_pool import BlockPool
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.runner import ModelRunner
from chatstore.model import LoadedModel, load_model
from chatstore.model.hf_export import hf_directory, transformers_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DECODE_CONTEXT = 512
PEER_SCRIPTS = Path(__file__).resolve().parents[2] / "shared" / "peers" / "vllm"


@dataclass(frozen=True)
class Plan:
    prefill_lens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_steps: int
    reps: int
    history_lens: tuple[int, ...] = (1024, 4096, 8000)


FULL = Plan((512, 1024, 2048), (1, 8, 32), decode_steps=16, reps=3)
QUICK = Plan((512, 2048), (1, 8, 32), decode_steps=4, reps=2, history_lens=(1024, 4096))
HISTORY_NEW_TOKENS = 100


@dataclass(frozen=True)
class PeerPlan:
    prefill_tokens: int
    decode_batches: tuple[int, ...]
    decode_tokens: int
    history_lens: tuple[int, ...]  # 7,900: room in the 8,192 context for 100 new tokens + a reply
    new_tokens: int
    reps: int


PEER_FULL = PeerPlan(2000, (1, 8, 32), 128, (1024, 4096, 7900), new_tokens=100, reps=3)
PEER_QUICK = PeerPlan(2000, (1, 8, 32), 128, (1024, 4096, 7900), new_tokens=100, reps=1)


def median_seconds(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Ours:
    """Our runner on its own paged KV pool, big enough for the largest case."""

    def __init__(self, model: LoadedModel, num_tokens: int, block_size: int = 16) -> None:
        num_blocks = num_tokens // block_size + 64
        self.kv = PagedKVCache(model.spec, num_blocks, block_size, model.dtype)
        self.pool = BlockPool(num_blocks)
        self.runner = ModelRunner(model.weights, model.spec, self.kv)
        self.block_size = block_size

    def blocks(self, num_tokens: int) -> list[int]:
        return self.pool.allocate(math.ceil(num_tokens / self.block_size))

    def prefill(self, ids: list[int], table: list[int]) -> torch.Tensor:
        batch = ForwardBatch.build([SequenceChunk(ids, 0, table)], self.block_size)
        return self.runner.forward(batch)

    def decode_loop(self, tables: list[list[int]], first: list[int], steps: int) -> list[int]:
        """`steps` greedy steps of every sequence, from DECODE_CONTEXT tokens of context."""
        tokens = first
        out = []
        for step in range(steps):
            chunks = [
                SequenceChunk([t], DECODE_CONTEXT + step, table)
                for t, table in zip(tokens, tables, strict=True)
            ]
            logits = self.runner.forward(ForwardBatch.build(chunks, self.block_size))
            tokens = logits.argmax(-1).tolist()
            out.append(tokens[0])
        return out


_HF: dict[int, Any] = {}


def hf_of(model: LoadedModel) -> Any:
    """transformers' model of `model` (its GGUF read by transformers, in the model's dtype),
    built once: the server itself builds none."""
    if id(model) not in _HF:
        _HF[id(model)] = transformers_model(model)
    return _HF[id(model)]


def hf_prefill(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    from transformers import DynamicCache

    with torch.inference_mode():
        out = hf_of(model)(
            input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1
        )
    return out.logits[:, -1].float()


def hf_decode_loop(model: LoadedModel, cache, first: torch.Tensor, steps: int) -> list[int]:
    tokens = first  # [b, 1]
    out = []
    with torch.inference_mode():
        for step in range(steps):
            pos = torch.tensor([DECODE_CONTEXT + step])
            logits = hf_of(model)(
                input_ids=tokens,
                past_key_values=cache,
                use_cache=True,
                cache_position=pos,
                position_ids=pos.expand(tokens.shape[0], 1),
            ).logits
            tokens = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(tokens[0, 0]))
        cache.crop(-steps)
    return out


def bench_prefill(model: LoadedModel, ours: Ours, n: int, reps: int) -> tuple[float, float, float]:
    """tok/s ours, tok/s transformers, max |logit diff| on the last token."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, model.spec.vocab_size, (n,), generator=g)
    table = ours.blocks(n)
    mine = ours.prefill(ids.tolist(), table)
    ref = hf_prefill(model, ids[None])
    t_ours = median_seconds(lambda: ours.prefill(ids.tolist(), table), reps)
    t_hf = median_seconds(lambda: hf_prefill(model, ids[None]), reps)
    ours.pool.free(table)
    return n / t_ours, n / t_hf, float((mine - ref).abs().max())


def bench_history_prefill(
    model: LoadedModel, ours: Ours, history: int, reps: int
) -> tuple[float, float, float]:
    """ms ours, ms our reference path, max |logit diff| between the two.

    (transformers is left out here: with a DynamicCache holding 1,024 tokens, its forward of 100
    new tokens took 6.6 s on this machine, ~6x its fresh prefill of all 1,124, which says more
    about its mask construction for a query shorter than the keys than about attention.)"""
    g = torch.Generator().manual_seed(history)
    ids = torch.randint(0, model.spec.vocab_size, (history + HISTORY_NEW_TOKENS,), generator=g)
    table = ours.blocks(len(ids))
    ours.prefill(ids[:history].tolist(), table)
    new = SequenceChunk(ids[history:].tolist(), history, table)
    reference = ModelRunner(model.weights, model.spec, ours.kv, attention="reference")
    batch = ForwardBatch.build([new], ours.block_size)
    diff = float((ours.runner.forward(batch) - reference.forward(batch)).abs().max())
    t_ours = median_seconds(lambda: ours.runner.forward(batch), reps)
    t_ref = median_seconds(lambda: reference.forward(batch), reps)
    ours.pool.free(table)
    return 1e3 * t_ours, 1e3 * t_ref, diff


def bench_decode(
    model: LoadedModel, ours: Ours, batch: int, steps: int, reps: int
) -> tuple[float, float, bool]:
    """tok/s ours, tok/s transformers, whether the greedy tokens agree."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.spec.vocab_size, (DECODE_CONTEXT,), generator=g)
    # One 512-token context, prefilled once, copied into every sequence's own blocks.
    src = ours.blocks(DECODE_CONTEXT + steps)
    first = int(ours.prefill(ids.tolist(), src).argmax(-1))
    tables = [ours.blocks(DECODE_CONTEXT + steps) for _ in range(batch)]
    for table in tables:
        for s, d in zip(src, table, strict=True):
            ours.kv.copy_block(s, d)
    cache = DynamicCache()
    with torch.inference_mode():
        hf_of(model)(input_ids=ids[None], past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(batch)
    mine = ours.decode_loop(tables, [first] * batch, steps)
    ref = hf_decode_loop(model, cache, torch.full((batch, 1), first), steps)
    t_ours = median_seconds(lambda: ours.decode_loop(tables, [first] * batch, steps), reps, 0)
    t_hf = median_seconds(
        lambda: hf_decode_loop(model, cache, torch.full((batch, 1), first), steps), reps, 0
    )
    for table in [src, *tables]:
        ours.pool.free(table)
    return batch * steps / t_ours, batch * steps / t_hf, mine == ref


def sharegpt_like_lengths(n: int, max_len: int, seed: int = 0) -> list[int]:
    """Prompt + output lengths like ShareGPT's (vLLM §6.1: mean input 161, output 338 tokens)."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(n):
        prompt = rng.lognormvariate(math.log(110), 0.9)
        output = rng.lognormvariate(math.log(250), 0.8)
        lengths.append(max(1, min(max_len, round(prompt + output))))
    return lengths


def kv_waste(lengths: list[int], block_size: int, max_context: int) -> tuple[float, float]:
    """Waste % of a paged pool (real BlockPool allocations) and of max-context reservations."""
    pool = BlockPool(sum(math.ceil(n / block_size) for n in lengths))
    tables = [pool.allocate(math.ceil(n / block_size)) for n in lengths]
    allocated = sum(len(t) for t in tables) * block_size
    used = sum(lengths)
    contiguous = len(lengths) * max_context
    return 100 * (allocated - used) / allocated, 100 * (contiguous - used) / contiguous


def served_default_dtype() -> str:
    """The compute dtype `chatstore serve` runs with no flags, resolved for this machine."""
    from chatstore import config

    cfg = config.load_config()
    resolve = getattr(config, "resolve_dtype", None)
    return resolve(cfg.dtype, cfg.device) if resolve is not None else cfg.dtype


def compare_transformers(
    model: LoadedModel, plan: Plan, dtype: str, result: dict[str, object]
) -> None:
    """The in-process columns: our runner and transformers on the same model object."""
    budget = max(max(plan.prefill_lens), (max(plan.decode_batches) + 1) * (DECODE_CONTEXT + 64))
    budget = max(budget, max(plan.history_lens) + HISTORY_NEW_TOKENS)
    ours = Ours(model, budget)
    attn_impl = getattr(hf_of(model).config, "_attn_implementation", "?")
    print(
        f"engine_speed: {dtype}, {torch.get_num_threads()} threads, torch {torch.__version__},"
        f" transformers attention={attn_impl}, {plan.reps} reps (median)"
    )
    result |= {"dtype": dtype, "threads": torch.get_num_threads()}
    cases = len(plan.prefill_lens) + len(plan.history_lens) + len(plan.decode_batches)
    with progress.progress_bar(cases, "in-process cases") as bar:
        _in_process_cases(model, ours, plan, result, bar.update)


def _in_process_cases(
    model: LoadedModel,
    ours: Ours,
    plan: Plan,
    result: dict[str, object],
    done: Callable[[], object],
) -> None:
    print(f"\n{'case':<22}{'ours tok/s':>12}{'hf tok/s':>12}{'ratio':>8}  check")
    for n in plan.prefill_lens:
        mine, ref, diff = bench_prefill(model, ours, n, plan.reps)
        key = f"{n // 1024}k" if n >= 1024 else str(n)
        print(
            f"{'prefill ' + str(n):<22}{mine:>12.1f}{ref:>12.1f}{mine / ref:>7.2f}x  d={diff:.1e}"
        )
        result |= {f"prefill_ours_{key}": mine, f"prefill_hf_{key}": ref}
        result[f"prefill_ratio_{key}"] = mine / ref
        done()
    print(f"\n{'100 new tokens on':<22}{'ours ms':>12}{'gather ms':>12}{'ratio':>8}  check")
    for n in plan.history_lens:
        mine, gather, diff = bench_history_prefill(model, ours, n, plan.reps)
        key = f"{round(n / 1024)}k"
        print(
            f"{str(n) + ' of history':<22}{mine:>12.1f}{gather:>12.1f}{gather / mine:>7.2f}x  "
            f"d={diff:.1e}"
        )
        result |= {f"history_ms_ours_{key}": mine, f"history_ms_gather_{key}": gather}
        result[f"history_vs_gather_{key}"] = gather / mine
        done()
    print(f"\n{'case':<22}{'ours tok/s':>12}{'hf tok/s':>12}{'ratio':>8}  check")
    for b in plan.decode_batches:
        mine, ref, same = bench_decode(model, ours, b, plan.decode_steps, plan.reps)
        label = f"decode b={b} ctx={DECODE_CONTEXT}"
        tokens = "tokens equal" if same else "TOKENS DIFFER"
        print(f"{label:<22}{mine:>12.1f}{ref:>12.1f}{mine / ref:>7.2f}x  {tokens}")
        result |= {f"decode_ours_b{b}": mine, f"decode_hf_b{b}": ref}
        result[f"decode_ratio_b{b}"] = mine / ref
        done()
    lengths = sharegpt_like_lengths(64, model.spec.max_context)
    paged, contiguous = kv_waste(lengths, 16, model.spec.max_context)
    print(
        f"\nKV waste, 64 ShareGPT-like sequences (mean {statistics.mean(lengths):.0f} tokens): "
        f"paged (block 16) {paged:.2f}%, contiguous max-context ({model.spec.max_context}) "
        f"reservation {contiguous:.1f}%"
    )
    result |= {"kv_waste_pct": paged, "kv_waste_contiguous_pct": contiguous}


# -- the served column: ours against vLLM-CPU --------------------------------------------------


@dataclass(frozen=True)
class Metric:
    label: str  # the table's row
    key: str  # JSON: {key}_vs_vllm_{suffix}
    unit: str  # JSON: served_ours_{key}_{unit}_{suffix}
    suffix: str
    faster_is_higher: bool
    ours: float
    vllm: dict[str, float]  # dtype -> value

    @property
    def best_dtype(self) -> str:
        pick = max if self.faster_is_higher else min
        return pick(self.vllm, key=lambda d: self.vllm[d])

    @property
    def speedup(self) -> float:
        """Above 1 when we are faster than the peer's faster dtype."""
        best = self.vllm[self.best_dtype]
        return self.ours / best if self.faster_is_higher else best / self.ours


def size_label(n: int) -> str:
    return f"{round(n / 1024)}k" if n >= 1000 else str(n)


def peer_plan(args: argparse.Namespace) -> PeerPlan:
    plan = PEER_QUICK if args.quick else PEER_FULL
    overrides = {
        "prefill_tokens": args.prefill_tokens,
        "decode_tokens": args.decode_tokens,
        "reps": args.peer_reps,
        "decode_batches": args.decode_batches and tuple(args.decode_batches),
        "history_lens": args.history_lens and tuple(args.history_lens),
    }
    return PeerPlan(**{**plan.__dict__, **{k: v for k, v in overrides.items() if v}})


def build_workload(tokenizer: object, plan: PeerPlan) -> Workload:
    maker = PromptMaker(tokenizer)
    lens = list(plan.history_lens)
    return Workload(
        warmup=maker.fresh_prompt("warm-up", min(512, plan.prefill_tokens)),
        warmup_history=maker.history_cases("warm-up-history", [512], plan.new_tokens)[0],
        prefill=[maker.fresh_prompt(f"prefill-{i}", plan.prefill_tokens) for i in range(plan.reps)],
        decode_batches=plan.decode_batches,
        decode_tokens=plan.decode_tokens,
        reps=plan.reps,
        history=[
            maker.history_cases(f"history-{i}", lens, plan.new_tokens) for i in range(plan.reps)
        ],
    )


def served_dtype(url: str) -> str | None:
    """The dtype the running server resolved (its /admin/cache says; local mode needs no key)."""
    try:
        with httpx.Client(trust_env=False, timeout=10) as http:
            return str(http.get(url + "/admin/cache").json()["engine"]["dtype"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None


def run_servers(
    args: argparse.Namespace, plan: PeerPlan, tokenizer: object, model_dir: Path, dtype: str
) -> tuple[ServedSpeed, dict[str, ServedSpeed], str, dict[str, ConcurrentPrefill]]:
    """Ours, then vLLM in each dtype: never two servers at once. Returns the dtype ours ran and
    the concurrent-prefill case per server ("ours", then each vLLM dtype)."""
    t0 = time.perf_counter()
    work = build_workload(tokenizer, plan)
    together = concurrent_prompts(
        PromptMaker(tokenizer), args.concurrent_prompts, args.concurrent_tokens, "together"
    )
    print(f"\nserved: prompts built in {time.perf_counter() - t0:.1f} s; {plan}", flush=True)
    vllm: dict[str, ServedSpeed] = {}
    concurrent: dict[str, ConcurrentPrefill] = {}
    with tempfile.TemporaryDirectory(prefix="engine_speed-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        t0 = time.perf_counter()
        with chatstore_server(data_dir, Path(tmp)) as server:
            dtype = served_dtype(server.url) or dtype
            ours = measure(server.url, work, True, _say(f"ours ({dtype})"))
            concurrent["ours"] = _concurrent(server.url, together, _say(f"ours ({dtype})"))
        print(f"  ours measured in {time.perf_counter() - t0:.0f} s", flush=True)
        for peer_dtype in args.vllm_dtypes:
            t0 = time.perf_counter()
            with vllm_server(args.vllm_scripts, peer_dtype, model_dir, Path(tmp)) as server:
                vllm[peer_dtype] = measure(server.url, work, False, _say(f"vLLM {peer_dtype}"))
                concurrent[peer_dtype] = _concurrent(server.url, together, _say(peer_dtype))
            print(f"  vLLM {peer_dtype} measured in {time.perf_counter() - t0:.0f} s", flush=True)
    return ours, vllm, dtype, concurrent


def _concurrent(
    url: str, prompts: list[list[dict[str, str]]], say: Callable[[str], None]
) -> ConcurrentPrefill:
    got = measure_concurrent_prefill(url, prompts)
    say(
        f"{len(prompts)} prompts of {got.prompt_tokens} tokens at once: mean TTFT "
        f"{got.mean_ttft_s:.2f} s (first {got.first_ttft_s:.2f}, last {got.last_ttft_s:.2f})"
    )
    return got


def concurrent_report(concurrent: dict[str, ConcurrentPrefill]) -> dict[str, object]:
    """concurrent_prefill_ttft_ratio: our mean TTFT over the faster vLLM dtype's (<= 1 good)."""
    ours = concurrent["ours"]
    peers = {d: c for d, c in concurrent.items() if d != "ours"}
    best = min(peers, key=lambda d: peers[d].mean_ttft_s)
    ratio = ours.mean_ttft_s / peers[best].mean_ttft_s
    print(
        f"concurrent prefill mean TTFT: ours {ours.mean_ttft_s:.2f} s, vLLM "
        f"{best} {peers[best].mean_ttft_s:.2f} s: ratio {ratio:.2f} (goal <= 1.0)"
    )
    out: dict[str, object] = {
        "concurrent_prefill_ttft_ratio": ratio,
        "concurrent_prefill_prompt_tokens": ours.prompt_tokens,
        "served_ours_concurrent_prefill_mean_ttft_s": ours.mean_ttft_s,
        "served_ours_concurrent_prefill_first_ttft_s": ours.first_ttft_s,
        "vllm_concurrent_prefill_mean_ttft_s": peers[best].mean_ttft_s,
        "vllm_concurrent_prefill_dtype": best,
    }
    return out | {
        f"vllm_{d}_concurrent_prefill_mean_ttft_s": c.mean_ttft_s for d, c in peers.items()
    }


def _say(who: str) -> Callable[[str], None]:
    return lambda line: print(f"  {who}: {line}", flush=True)


def served_metrics(plan: PeerPlan, ours: ServedSpeed, vllm: dict[str, ServedSpeed]) -> list[Metric]:
    pre = f"prefill {plan.prefill_tokens} tok/s"
    rows = [
        Metric(pre, "prefill", "tok_s", size_label(plan.prefill_tokens), True, ours.prefill_tok_s,
               {d: v.prefill_tok_s for d, v in vllm.items()}),
    ]  # fmt: skip
    for b in plan.decode_batches:
        rows.append(
            Metric(f"decode b={b} tok/s", "decode", "tok_s", f"b{b}", True, ours.decode_tok_s[b],
                   {d: v.decode_tok_s[b] for d, v in vllm.items()})
        )  # fmt: skip
    for n in plan.history_lens:
        rows.append(
            Metric(f"history {n}+{plan.new_tokens} TTFT ms", "history_prefill", "ttft_s",
                   size_label(n), False, ours.history_ttft_s[n],
                   {d: v.history_ttft_s[n] for d, v in vllm.items()})
        )  # fmt: skip
    return rows


def served_report(
    plan: PeerPlan, ours: ServedSpeed, vllm: dict[str, ServedSpeed], dtype: str
) -> dict[str, object]:
    rows = served_metrics(plan, ours, vllm)
    print(f"\nserved, one server at a time (ours: chatstore serve, {dtype}; best of vLLM dtypes)")
    print(f"{'case':<28}{'ours':>10}" + "".join(f"{'vLLM ' + d:>16}" for d in vllm) + "   speedup")
    out: dict[str, object] = {"served_dtype": dtype, "vllm_dtypes": ",".join(vllm)}
    for m in rows:
        scale = 1000 if m.unit == "ttft_s" else 1  # the table shows TTFT in ms
        cells = "".join(f"{m.vllm[d] * scale:>16.1f}" for d in vllm)
        print(f"{m.label:<28}{m.ours * scale:>10.1f}{cells}{m.speedup:>8.2f}x vs {m.best_dtype}")
        out[f"{m.key}_vs_vllm_{m.suffix}"] = m.speedup
        out[f"served_ours_{m.key}_{m.unit}_{m.suffix}"] = m.ours
        out[f"vllm_{m.key}_{m.unit}_{m.suffix}"] = m.vllm[m.best_dtype]
        out[f"vllm_{m.key}_{m.suffix}_dtype"] = m.best_dtype
        out |= {f"vllm_{d}_{m.key}_{m.unit}_{m.suffix}": v for d, v in m.vllm.items()}
    out |= served_checks(plan, ours, vllm)
    return out


def served_checks(
    plan: PeerPlan, ours: ServedSpeed, vllm: dict[str, ServedSpeed]
) -> dict[str, object]:
    """Prompt sizes both sides saw, the history's cache hits, and anything that looked off."""
    out: dict[str, object] = {"served_prefill_prompt_tokens": ours.prefill_tokens}
    warnings = [f"ours: {w}" for w in ours.warnings]
    for d, v in vllm.items():
        warnings += [f"vLLM {d}: {w}" for w in v.warnings]
        if v.prefill_tokens != ours.prefill_tokens or v.history_tokens != ours.history_tokens:
            warnings.append(f"vLLM {d} counted other prompt sizes than ours")
    for n in plan.history_lens:
        label = size_label(n)
        out[f"served_history_prompt_tokens_{label}"] = ours.history_tokens[n]
        out[f"served_ours_history_cached_{label}"] = ours.history_cached[n]
        out |= {f"vllm_{d}_history_cached_{label}": v.history_cached[n] for d, v in vllm.items()}
    hits = ", ".join(
        f"{n}: ours {ours.history_cached[n]}, vLLM "
        + "/".join(str(v.history_cached[n]) for v in vllm.values())
        for n in plan.history_lens
    )
    print(f"history prompt tokens cached (second request) {hits}")
    for w in warnings:
        print(f"WARNING {w}")
    if warnings:
        out["served_warnings"] = warnings
    return out


def _exit_on_signal(signum: int, _frame: object) -> None:
    # Servers first: a client thread in the middle of a stream then fails at once instead of
    # holding the exit until its stream ends.
    stop_all_servers()
    sys.exit(128 + signum)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, steps and repetitions")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), help="in-process dtype (default: what serve runs)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    peer = parser.add_argument_group("served, against vLLM's CPU build")
    peer.add_argument("--vllm", action="store_true", help="add the served column against vLLM")
    peer.add_argument(
        "--vllm-dtypes", type=lambda s: s.split(","), default=["bfloat16", "float32"],
        help="vLLM dtypes, each its own server in turn (default bfloat16,float32)",
    )  # fmt: skip
    peer.add_argument("--vllm-scripts", type=Path, default=PEER_SCRIPTS, help="setup.sh, serve.sh")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    # Smaller served cases, for trying the bench out; the defaults are the issue's.
    peer.add_argument("--prefill-tokens", type=int)
    peer.add_argument("--decode-tokens", type=int)
    peer.add_argument("--decode-batches", type=ints)
    peer.add_argument("--history-lens", type=ints)
    peer.add_argument("--peer-reps", type=int)
    peer.add_argument("--concurrent-prompts", type=int, default=PROMPTS)
    peer.add_argument("--concurrent-tokens", type=int, default=PROMPT_TOKENS)
    progress.add_argument(parser)
    args = parser.parse_args()
    progress.configure(args)
    return args


def main() -> None:
    args = parse_args()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    if args.vllm:
        ensure_vllm(args.vllm_scripts)  # before minutes of in-process work, not after
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or served_default_dtype()
    print(f"machine: {describe()}", flush=True)
    model = load_model(dtype=DTYPES[dtype])
    result: dict[str, object] = machine_report()
    compare_transformers(model, QUICK if args.quick else FULL, dtype, result)
    if args.vllm:
        plan = peer_plan(args)
        # vLLM loads a Hugging Face directory: the GGUF as transformers reads it, in fp32
        model_dir = hf_directory(model.gguf) if model.gguf is not None else model.path
        tokenizer = model.tokenizer
        del model  # the servers load their own copies; the bench keeps only the tokenizer
        gc.collect()
        ours, vllm, served, together = run_servers(
            args, plan, tokenizer, model_dir, served_default_dtype()
        )
        if served != dtype:
            print(f"WARNING the server runs {served}; the in-process columns ran {dtype}")
        result |= served_report(plan, ours, vllm, served)
        result |= concurrent_report(together)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
