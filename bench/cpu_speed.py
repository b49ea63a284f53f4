"""The served configuration's forward speed on this CPU, ours only, in process: prefill of one
fresh prompt of 512 and 2,048 tokens, decode at batch 1 and 8 on 512 tokens of context (the
runtime `chatstore serve` builds: create_runtime with the config's defaults, or --set overrides).

It exists to compare CPU paths and code versions on one machine (issue 32):

- Another CPU kind, approximately, on this one: torch, oneDNN and MKL held to AVX2 and the
  CPU's AVX512 / AMX flags hidden from chatstore's own choices (`make test-avx2`'s variables),
  so `dtype = auto` and `weights = auto` choose what they serve on an AVX2-only CPU:

      ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
      CHATSTORE_HIDE_CPU_FLAGS='avx512*,amx*,avx_vnni*,avx_ne_convert*' python bench/cpu_speed.py

  A tree older than CHATSTORE_HIDE_CPU_FLAGS (before 6b12531) needs those choices pinned
  instead: CHATSTORE_KERNEL_ISA=avx2 CHATSTORE_INT4_KERNEL=native, `--set dtype=float32
  --set weights=int4`.

- Before / after: run it with PYTHONPATH pointing at an older checkout (a `git worktree` with
  `chatstore/kernels` linked to its `kernels/`, and CHATSTORE_KERNEL_CACHE set apart, as its
  kernels build under the same name), alternating with the current tree.

Timings are the best of 3 (prefill) and of 3 runs of 16 steps (decode): this project's machines
drift by tens of percent between runs, so compare only runs taken back to back, alternating.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Appended, not prepended: PYTHONPATH (an older tree to compare with) comes first.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from chatstore.config import load_config
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.runtime import Runtime, create_runtime

DECODE_CONTEXT = 512
DECODE_STEPS = 16


def best_seconds(fn: Callable[[], object], reps: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def prefill_tok_s(rt: Runtime, n: int, gen: torch.Generator) -> float:
    bs = rt.kv_cache.block_size
    ids = torch.randint(0, rt.model.spec.vocab_size, (n,), generator=gen).tolist()
    table = rt.pool.allocate((n + bs - 1) // bs)
    batch = lambda: ForwardBatch.build([SequenceChunk(ids, 0, table)], bs)  # noqa: E731
    seconds = best_seconds(lambda: rt.runner.forward(batch()))
    rt.pool.free(table)
    return n / seconds


def decode_tok_s(rt: Runtime, batch: int, gen: torch.Generator) -> float:
    bs = rt.kv_cache.block_size
    tables = []
    for _ in range(batch):
        ids = torch.randint(0, rt.model.spec.vocab_size, (DECODE_CONTEXT,), generator=gen)
        table = rt.pool.allocate((DECODE_CONTEXT + DECODE_STEPS + bs - 1) // bs)
        rt.runner.forward(ForwardBatch.build([SequenceChunk(ids.tolist(), 0, table)], bs))
        tables.append(table)

    def steps() -> None:
        for step in range(DECODE_STEPS):
            chunks = [SequenceChunk([5], DECODE_CONTEXT + step, t) for t in tables]
            rt.runner.forward(ForwardBatch.build(chunks, bs))

    seconds = best_seconds(steps)
    for table in tables:
        rt.pool.free(table)
    return batch * DECODE_STEPS / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", action="append", default=[], help="a config override key=value")
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)
    config = load_config(overrides=overrides)
    rt = create_runtime(config)
    gen = torch.Generator().manual_seed(0)
    try:
        from bench.machine import machine_report

        result: dict[str, object] = machine_report()
    except (ImportError, AttributeError):  # an older tree, before the kernel variants
        result = {"kernel_variant": "older tree"}
    result["dtype"] = str(config.torch_dtype)
    result["overrides"] = overrides
    with torch.inference_mode():
        for n in (512, 2048):
            result[f"prefill_{n}_tok_s"] = round(prefill_tok_s(rt, n, gen), 1)
        for batch in (1, 8):
            result[f"decode_b{batch}_tok_s"] = round(decode_tok_s(rt, batch, gen), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
