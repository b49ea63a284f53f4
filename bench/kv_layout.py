"""KV layouts side by side: the paged pool (native paged kernels) against vAttention (per-request
contiguous KV in reserved address space, pages committed on demand, stock SDPA).

Both layouts run in one process on the same model object (the embedded default, in the dtype
`dtype = auto` serves on this CPU unless --dtype says otherwise; the JSON names it, and the CPU)
and threads; every `*_ratio_*` key is vattention / paged, speed over speed (above 1: vAttention
is faster):

    decode    tok/s at batch 1, 8, 32 on 512 and 4K tokens of context (greedy, every sequence
              its own copy of one prefilled context); decode_ratio_b1 / _b8 / _b32 are at 512,
              decode_ratio_b*_4k at 4K
    prefill   one fresh 2K-token prompt (prefill_ratio_2k)
    history   100 new tokens on 4K tokens of history already in the pool
              (history_prefill_ratio_4k)
    waste     64 ShareGPT-like sequence lengths: (committed - used) / committed in %. Paged:
              whole blocks of 16 handed out (the pool itself is committed up front at start);
              vAttention: the mapping's real RSS after committing each sequence's tokens in
              4 KB pages (waste_pct_vattention), and computed for 2 MB pages
              (waste_pct_vattention_2m: a 2 MB page per layer K/V buffer at least)
    alloc     the time forwards waited for a page to be committed, in % of step time, over an
              engine run with arrivals and finishes (alloc_wait_pct; goal < 2%), and whether
              the kernel granted 2 MB pages (/proc/self/smaps AnonHugePages)

The last line printed is one JSON object.

    python bench/kv_layout.py [--quick] [--dtype auto|bfloat16|float32] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_speed import sharegpt_like_lengths
from chatstore.config import Config, cpu_has_fast_bf16, resolve_dtype
from chatstore.engine.block_pool import BlockPool
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache, bytes_per_block
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request, SamplingParams
from chatstore.engine.runner import ModelRunner
from chatstore.engine.runtime import create_runtime
from chatstore.engine.vattention import create_virtual_kv
from chatstore.engine.vattention.virtual_memory import HUGE_PAGE, VirtualRegion
from chatstore.model import LoadedModel, load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYOUTS = ("paged", "vattention")
HISTORY_NEW_TOKENS = 100


@dataclass(frozen=True)
class Plan:
    decode: tuple[tuple[int, int], ...]  # (batch, context)
    decode_steps: int
    prefill_len: int
    history_len: int
    reps: int
    engine_requests: int
    engine_max_tokens: int


FULL = Plan(
    tuple((b, c) for c in (512, 4096) for b in (1, 8, 32)),
    decode_steps=16,
    prefill_len=2048,
    history_len=4096,
    reps=3,
    engine_requests=32,
    engine_max_tokens=64,
)
QUICK = Plan(
    ((1, 512), (8, 512), (32, 512), (1, 4096), (8, 4096)),
    decode_steps=4,
    prefill_len=2048,
    history_len=4096,
    reps=2,
    engine_requests=8,
    engine_max_tokens=16,
)


def interleaved_medians(cases: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each case, the layouts taking turns within every repetition so that a
    busy machine slows both alike; one warm-up call each."""
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


class Layout:
    """One KV layout's runner and pool, sized for `num_tokens` tokens across `num_seqs`."""

    def __init__(self, name: str, model: LoadedModel, num_tokens: int, num_seqs: int) -> None:
        self.name, self.block_size = name, 16
        spec, dtype = model.spec, model.dtype
        num_blocks = num_tokens // self.block_size + 4 * num_seqs
        if name == "paged":
            self.kv = PagedKVCache(spec, num_blocks, self.block_size, dtype)
            self.pool = BlockPool(num_blocks)
        else:
            budget = num_blocks * bytes_per_block(spec, self.block_size, dtype)
            self.kv, self.pool = create_virtual_kv(spec, num_seqs, budget, self.block_size, dtype)
        self.runner = ModelRunner(model.hf_model, spec, self.kv)

    def table(self, num_tokens: int) -> list[int]:
        return self.pool.allocate(math.ceil(num_tokens / self.block_size))

    def copy(self, src: list[int], dst: list[int], num_tokens: int) -> None:
        n = math.ceil(num_tokens / self.block_size)
        if self.name == "vattention":
            self.kv.copy_blocks(src[:n], dst[:n])
        else:
            index = torch.tensor(dst[:n])
            self.kv.kv.index_copy_(2, index, self.kv.kv[:, :, src[:n]])

    def forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        return self.runner.forward(ForwardBatch.build(chunks, self.block_size))

    @property
    def alloc_wait_s(self) -> float:
        return self.kv.pages.wait_s if self.name == "vattention" else 0.0


Case = tuple[Callable[[], object], Callable[[], None]]  # (what is timed, clean-up)


def decode_case(lay: Layout, batch: int, context: int, steps: int) -> Case:
    """`steps` greedy steps of `batch` sequences, each its own copy of one prefilled context;
    the timed call returns sequence 0's tokens."""
    g = torch.Generator().manual_seed(context)
    ids = torch.randint(0, 49152, (context,), generator=g).tolist()
    src = lay.table(context + steps)
    first = int(lay.forward([SequenceChunk(ids, 0, src)]).argmax(-1))
    tables = [src] + [lay.table(context + steps) for _ in range(batch - 1)]
    for t in tables[1:]:
        lay.copy(src, t, context)

    def loop() -> list[int]:
        tokens, out = [first] * batch, []
        for step in range(steps):
            chunks = [
                SequenceChunk([t], context + step, tb) for t, tb in zip(tokens, tables, strict=True)
            ]
            tokens = lay.forward(chunks).argmax(-1).tolist()
            out.append(tokens[0])
        return out

    def done() -> None:
        for t in tables:
            lay.pool.free(t)

    return loop, done


def prefill_case(lay: Layout, n: int) -> Case:
    ids = torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    table = lay.table(n)
    return (lambda: lay.forward([SequenceChunk(ids, 0, table)])), lambda: lay.pool.free(table)


def history_case(lay: Layout, history: int) -> Case:
    """100 new tokens on `history` tokens already in the pool."""
    g = torch.Generator().manual_seed(history)
    ids = torch.randint(0, 49152, (history + HISTORY_NEW_TOKENS,), generator=g).tolist()
    table = lay.table(len(ids))
    lay.forward([SequenceChunk(ids[:history], 0, table)])
    new = [SequenceChunk(ids[history:], history, table)]
    return (lambda: lay.forward(new)), lambda: lay.pool.free(table)


def run_cases(layouts: dict[str, Layout], make: Callable[[Layout], Case], reps: int):
    """Seconds per layout, and what each layout's timed call returned."""
    cases = {name: make(lay) for name, lay in layouts.items()}
    results = {name: fn() for name, (fn, _) in cases.items()}
    seconds = interleaved_medians({name: fn for name, (fn, _) in cases.items()}, reps)
    for _, done in cases.values():
        done()
    return seconds, results


def waste(model: LoadedModel, lengths: list[int]) -> dict[str, float]:
    """(committed - used) / committed in %, per layout, on the same sequence lengths."""
    spec, dtype, block = model.spec, model.dtype, 16
    blocks = sum(math.ceil(n / block) for n in lengths)
    paged = 100 * (blocks * block - sum(lengths)) / (blocks * block)
    budget = (blocks + len(lengths)) * bytes_per_block(spec, block, dtype)
    kv, pool = create_virtual_kv(spec, len(lengths), budget, block, dtype)
    for n in lengths:
        table = pool.allocate(math.ceil(n / block))
        kv.pages.ensure(kv.slot_of(table[0]), n)
    buffers = 2 * spec.num_layers
    used = sum(lengths) * kv.token_bytes * buffers
    rss = kv.rss_bytes()
    huge = sum(buffers * -(-n * kv.token_bytes // HUGE_PAGE) * HUGE_PAGE for n in lengths)
    kv.pages.trim()  # nothing idle: every slot is still live, so nothing is given back
    return {
        "waste_pct_paged": paged,
        "waste_pct_vattention": 100 * (rss - used) / rss,
        "waste_pct_vattention_2m": 100 * (huge - used) / huge,
        "waste_used_mb": used / 2**20,
        "waste_committed_mb_vattention": rss / 2**20,
    }


def huge_pages_granted() -> int:
    """Commit 8 MB with MADV_HUGEPAGE: the bytes the kernel backed with 2 MB pages."""
    region = VirtualRegion(8 << 20, HUGE_PAGE, huge=True)
    region.commit(0, 8 << 20)
    granted = region.huge_page_bytes()
    region.close()
    return granted


def engine_run(model: LoadedModel, layout: str, plan: Plan, dtype: str) -> dict[str, float]:
    """Continuous batching with arrivals and finishes; tok/s and (vattention) page waits."""
    config = Config(kv_layout=layout, kv_cache_bytes=1 << 30, max_running=16, dtype=dtype)
    runtime = create_runtime(config, model=model)
    engine = LLMEngine(runtime, EngineConfig(max_running=16, max_tokens_per_step=512))
    rng = random.Random(5)
    pending = [
        Request(
            f"r{i}",
            [rng.randrange(2, 49152) for _ in range(rng.randint(64, 700))],
            SamplingParams(max_tokens=plan.engine_max_tokens, temperature=0.0, ignore_eos=True),
        )
        for i in range(plan.engine_requests)
    ]
    step_s, t0 = 0.0, time.perf_counter()
    while pending or engine.has_work():
        while pending and (not engine.has_work() or rng.random() < 0.3):
            engine.add_request(pending.pop(0))
        s0 = time.perf_counter()
        engine.step()
        step_s += time.perf_counter() - s0
    wall = time.perf_counter() - t0
    out = {"tok_s": engine.tokens_generated / wall, "step_s": step_s}
    if layout == "vattention":
        pages = runtime.kv_cache.pages
        out |= {
            "wait_s": pages.wait_s,
            "sync_commits": pages.sync_commits,
            "background_commits": pages.background_commits,
        }
        pages.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases, one repetition")
    parser.add_argument(
        "--dtype", choices=["auto", *DTYPES], default="auto", help="auto: what serving picks here"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = QUICK if args.quick else FULL
    args.dtype = resolve_dtype(args.dtype)  # bf16 only on a CPU that computes it natively
    model = load_model(dtype=DTYPES[args.dtype])
    max_batch = max(b for b, _ in plan.decode)
    need = max(
        max((b + 1) * (c + plan.decode_steps) for b, c in plan.decode),
        plan.history_len + HISTORY_NEW_TOKENS,
    )
    print(f"kv_layout: {args.dtype}, {torch.get_num_threads()} threads, {plan.reps} reps")
    result: dict[str, object] = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    result["cpu_native_bf16"] = cpu_has_fast_bf16()
    layouts = {name: Layout(name, model, need, max_batch + 1) for name in LAYOUTS}
    va_pages = layouts["vattention"].kv.pages
    for b, c in plan.decode:
        seconds, tokens = run_cases(
            layouts, lambda lay, b=b, c=c: decode_case(lay, b, c, plan.decode_steps), plan.reps
        )
        tok_s = {name: b * plan.decode_steps / t for name, t in seconds.items()}
        key = f"decode_ratio_b{b}" + ("" if c == 512 else f"_{c // 1024}k")
        result[key] = tok_s["vattention"] / tok_s["paged"]
        result |= {f"decode_tok_s_{name}_b{b}_{c}": v for name, v in tok_s.items()}
        result[f"decode_same_tokens_b{b}_{c}"] = tokens["paged"] == tokens["vattention"]
        print(f"decode b={b:<3} ctx={c:<5}" + _row(tok_s, "tok/s"))
    seconds, _ = run_cases(layouts, lambda lay: prefill_case(lay, plan.prefill_len), plan.reps)
    result["prefill_ratio_2k"] = seconds["paged"] / seconds["vattention"]
    print(f"prefill {plan.prefill_len:<13}" + _row(_ms(seconds), "ms"))
    seconds, _ = run_cases(layouts, lambda lay: history_case(lay, plan.history_len), plan.reps)
    result["history_prefill_ratio_4k"] = seconds["paged"] / seconds["vattention"]
    result |= {f"history_ms_{name}_4k": v for name, v in _ms(seconds).items()}
    print(f"100 on {plan.history_len} history" + _row(_ms(seconds), "ms"))
    va_pages.close()
    del layouts
    result |= waste(model, sharegpt_like_lengths(64, 4096))
    print(
        f"waste: paged {result['waste_pct_paged']:.2f}%, vattention 4 KB pages "
        f"{result['waste_pct_vattention']:.2f}%, "
        f"2 MB pages {result['waste_pct_vattention_2m']:.1f}%"
    )
    runs = {name: engine_run(model, name, plan, args.dtype) for name in LAYOUTS}
    va_run = runs["vattention"]
    result["alloc_wait_pct"] = 100 * va_run["wait_s"] / va_run["step_s"]
    result["engine_tok_s_ratio"] = va_run["tok_s"] / runs["paged"]["tok_s"]
    result |= {f"engine_{k}_vattention": v for k, v in va_run.items()}
    result["engine_tok_s_paged"] = runs["paged"]["tok_s"]
    result["hugepage_granted_bytes"] = huge_pages_granted()
    print(json.dumps(result))


def _ms(seconds: dict[str, float]) -> dict[str, float]:
    return {name: 1e3 * t for name, t in seconds.items()}


def _row(values: dict[str, float], unit: str) -> str:
    return "".join(f"  {name} {v:9.1f} {unit}" for name, v in values.items())


if __name__ == "__main__":
    main()
