"""Prefill on quantized weights without a 16-bit copy (issue 35 item 2): expand vs copy.

`prefill_weights = expand` multiplies a prompt by each quantized weight expanded just in time
into one shared buffer; `copy` keeps a prepacked 16-bit copy of every projection beside its
quantized weight (what chatstore did before, and what `auto` keeps while the copies take at most
1 GiB). For each mode, in fresh processes taken in ABBA order (`--runs` of each):

    weights_mb        bytes of every tensor the runner holds (storages counted once: the
                      embeddings, norms, quantized weights, 16-bit copies, the scratch buffer)
    gguf_mb           the GGUF file's tensor bytes; weights_ratio = weights_mb / gguf_mb
    steady_rss_mb     the process's resident set after loading and the prefills (KV pool 64 MB)
    prefill_T         prefill tok/s of a fresh T-token prompt, the best of 4 after a warm-up

Ratios expand / copy per key; last line one JSON object. Run it alone on the machine.

    python bench/prefill_weights.py [--runs 2] [--model default|PATH.gguf] [--lengths 64,512,2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("copy", "expand")


def _tensors(obj: object, seen: set[int], depth: int = 0) -> int:
    """Bytes of the tensor storages reachable from `obj` (attributes, lists), each once."""
    import torch

    if isinstance(obj, torch.Tensor):
        try:
            storage = obj.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except NotImplementedError:  # oneDNN's prepacked weights: opaque, their own memory
            key, nbytes = id(obj), obj.numel() * obj.element_size()
        if key in seen:
            return 0
        seen.add(key)
        return nbytes
    if depth > 4 or obj is None or isinstance(obj, (int, float, str, bool)):
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(_tensors(item, seen, depth + 1) for item in obj)
    fields = getattr(obj, "__dict__", None)
    if fields is None and hasattr(obj, "_fields"):  # NamedTuple
        return sum(_tensors(getattr(obj, f), seen, depth + 1) for f in obj._fields)
    if fields is None:
        return 0
    return sum(_tensors(value, seen, depth + 1) for value in fields.values())


def one(mode: str, model: str, lengths: list[int]) -> dict[str, float | str]:
    import torch

    from chatstore.config import Config
    from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
    from chatstore.engine.runtime import create_runtime
    from chatstore.model.gguf_weights import GGUFWeights

    config = Config(model=model, kv_cache_bytes=64 << 20, kv_store="off", prefill_weights=mode)
    runtime = create_runtime(config)
    runner = runtime.runner
    seen: set[int] = {runtime.kv_cache.kv.untyped_storage().data_ptr()}  # the KV pool: not weights
    out: dict[str, float | str] = {"mode": mode, "dtype": str(runner.dtype).split(".")[-1]}
    gguf = runtime.model.gguf
    if gguf is not None:
        tensors = GGUFWeights(gguf, runtime.model.spec).tensors.values()
        out["gguf_mb"] = sum(int(t.data.nbytes) for t in tensors) / 2**20
    generator = torch.Generator().manual_seed(0)
    bs = runtime.block_size
    for n in lengths:
        times = []
        for _ in range(5):
            ids = torch.randint(100, 20000, (n,), generator=generator).tolist()
            batch = ForwardBatch.build([SequenceChunk(ids, 0, list(range(-(-n // bs))))], bs)
            start = time.perf_counter()
            runner.forward(batch)
            times.append(time.perf_counter() - start)
        out[f"prefill_{n}"] = n / min(times[1:])
    out["weights_mb"] = _tensors(runner, seen) / 2**20
    with open("/proc/self/statm") as f:
        out["steady_rss_mb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", default="64,512,2000")
    parser.add_argument("--one", choices=MODES, help="one measurement, in this process")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.one:
        print(json.dumps(one(args.one, args.model, lengths)))
        return
    from bench.machine import machine_report

    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    order = [m for i in range(args.runs) for m in (MODES if i % 2 == 0 else MODES[::-1])]
    for mode in order:
        cmd = [sys.executable, __file__, "--one", mode, "--model", args.model]
        cmd += ["--lengths", args.lengths]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(runs[mode][-1], file=sys.stderr, flush=True)
    keys = [k for k in runs["copy"][0] if k not in ("mode", "dtype")]
    summary: dict[str, object] = {"model": args.model, "dtype": runs["copy"][0]["dtype"]}
    for key in keys:
        values = {m: statistics.median(r[key] for r in runs[m]) for m in MODES}
        for m in MODES:
            summary[f"{key}_{m}"] = round(values[m], 1)
        if key != "gguf_mb":
            summary[f"{key}_ratio"] = round(values["expand"] / values["copy"], 3)
        print(f"{key:16s} copy {values['copy']:9.1f}  expand {values['expand']:9.1f}")
    if "gguf_mb" in keys:
        for m in MODES:
            ratio = summary[f"weights_mb_{m}"] / summary["gguf_mb_copy"]  # type: ignore[operator]
            summary[f"weights_vs_gguf_{m}"] = round(ratio, 3)
    summary["runs"] = args.runs
    summary["machine"] = machine_report()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
