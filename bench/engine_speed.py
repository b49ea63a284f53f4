"""Engine speed against transformers eager, side by side, on the same model object and threads.

    prefill  tokens/s for one fresh prompt of 512, 1K, 2K tokens (logits of the last token only)
    decode   tokens/s at batch 1, 8, 32, each sequence on 512 tokens of context, greedy
    KV waste allocated-but-unused slots / allocated slots on a mixed-length batch (block size 16),
             against a contiguous reservation of the maximum context per request

Transformers runs its own decode loop the way `generate` does inside: batched `model(...)` steps
over a DynamicCache (past_key_values), the next token the argmax of the last. Every number is the
median of a few timed repetitions after a warm-up. The last line printed is one JSON object.

    python bench/engine_speed.py [--quick] [--dtype float32|bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.runner import ModelRunner
from chatstore.model import LoadedModel, load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DECODE_CONTEXT = 512


@dataclass(frozen=True)
class Plan:
    prefill_lens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_steps: int
    reps: int


FULL = Plan((512, 1024, 2048), (1, 8, 32), decode_steps=16, reps=3)
QUICK = Plan((512, 2048), (1, 8, 32), decode_steps=4, reps=2)


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
        self.runner = ModelRunner(model.hf_model, model.spec, self.kv)
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


def hf_prefill(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    from transformers import DynamicCache

    with torch.inference_mode():
        out = model.hf_model(
            input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1
        )
    return out.logits[:, -1].float()


def hf_decode_loop(model: LoadedModel, cache, first: torch.Tensor, steps: int) -> list[int]:
    tokens = first  # [b, 1]
    out = []
    with torch.inference_mode():
        for step in range(steps):
            pos = torch.tensor([DECODE_CONTEXT + step])
            logits = model.hf_model(
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
        model.hf_model(input_ids=ids[None], past_key_values=cache, use_cache=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, steps and repetitions")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = QUICK if args.quick else FULL
    model = load_model(dtype=DTYPES[args.dtype])
    budget = max(max(plan.prefill_lens), (max(plan.decode_batches) + 1) * (DECODE_CONTEXT + 64))
    ours = Ours(model, budget)
    attn_impl = getattr(model.hf_model.config, "_attn_implementation", "?")
    print(
        f"engine_speed: {args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__},"
        f" transformers attention={attn_impl}, {plan.reps} reps (median)"
    )
    result: dict[str, object] = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    print(f"\n{'case':<22}{'ours tok/s':>12}{'hf tok/s':>12}{'ratio':>8}  check")
    for n in plan.prefill_lens:
        mine, ref, diff = bench_prefill(model, ours, n, plan.reps)
        key = f"{n // 1024}k" if n >= 1024 else str(n)
        print(
            f"{'prefill ' + str(n):<22}{mine:>12.1f}{ref:>12.1f}{mine / ref:>7.2f}x  d={diff:.1e}"
        )
        result |= {f"prefill_ours_{key}": mine, f"prefill_hf_{key}": ref}
        result[f"prefill_ratio_{key}"] = mine / ref
    for b in plan.decode_batches:
        mine, ref, same = bench_decode(model, ours, b, plan.decode_steps, plan.reps)
        label = f"decode b={b} ctx={DECODE_CONTEXT}"
        tokens = "tokens equal" if same else "TOKENS DIFFER"
        print(f"{label:<22}{mine:>12.1f}{ref:>12.1f}{mine / ref:>7.2f}x  {tokens}")
        result |= {f"decode_ours_b{b}": mine, f"decode_hf_b{b}": ref}
        result[f"decode_ratio_b{b}"] = mine / ref
    lengths = sharegpt_like_lengths(64, model.spec.max_context)
    paged, contiguous = kv_waste(lengths, 16, model.spec.max_context)
    print(
        f"\nKV waste, 64 ShareGPT-like sequences (mean {statistics.mean(lengths):.0f} tokens): "
        f"paged (block 16) {paged:.2f}%, contiguous max-context ({model.spec.max_context}) "
        f"reservation {contiguous:.1f}%"
    )
    result |= {"kv_waste_pct": paged, "kv_waste_contiguous_pct": contiguous}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
