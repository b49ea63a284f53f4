"""Layer-wise pre-load of history KV (CachedAttention §3.2.1, the paper's Fig. 19).

Prefill of --new (100) new tokens of a session whose --history (1,000) tokens of KV come from the
DRAM tier, default model, driving ModelRunner.forward and the StoreConnector directly:

    (a) no_preload  connector.load (all layers into the pool, RoPE re-applied), then the forward
    (b) preload     connector.start_load; forward(layer_ready=connector.wait_for_layer) waits
                    for each layer's copy right before that layer's attention; finish_loads()
    (c) compute     the forward alone, the history KV already resident in the pool
    load            connector.load alone (what (a) adds to (c), ideally)

Each is timed --reps times, interleaved; the median counts. Printed last as one JSON line, with
    load_hidden_pct = 100 * (a - b) / (a - c), clipped to [0, 100]
(the share of the load time that overlapping took off the critical path). --layer-delay-ms adds
a sleep per layer copied (a slower tier than DRAM, as in the tests).

Not implemented: the HBM read buffer (Fig. 6(c): starting the next job's pre-load while the
current job still runs) and the larger pre-load buffer of Fig. 7(b); a load starts with its step.
On a CPU host the loader thread (1 torch thread) shares the cores with the forward, so the
overlap is bounded by what the machine has spare.

    python bench/preload.py [--history 1000] [--new 100] [--reps 7] [--layer-delay-ms 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from chatstore.config import load_config  # noqa: E402
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk  # noqa: E402
from chatstore.engine.request import Request, SamplingParams  # noqa: E402
from chatstore.engine.runtime import create_runtime  # noqa: E402
from chatstore.store import StoreConnector, create_store  # noqa: E402
from chatstore.store.session_kv import SessionKV  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=int, default=1000)
    parser.add_argument("--new", type=int, default=100)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--layer-delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="chatstore-bench-preload-"))
    config = load_config(overrides={"data_dir": str(data), "enable_prefix_cache": False})
    runtime = create_runtime(config)
    spec, cache, runner = runtime.model.spec, runtime.kv_cache, runtime.runner
    store = create_store(config, spec, runtime.model.fingerprint)
    assert store is not None
    conn = StoreConnector(store, cache, runner.rope, layer_delay_s=args.layer_delay_ms / 1000)

    g = torch.Generator().manual_seed(0)
    total = args.history + args.new
    ids = torch.randint(10, spec.vocab_size, (total,), generator=g).tolist()
    B = cache.block_size
    table = list(range(-(-total // B)))
    assert len(table) <= cache.num_blocks

    # The history's pre-RoPE KV, as turn 1 would have saved it, put in the DRAM tier.
    hist = SessionKV(ids[: args.history], _history_kv(runner, ids[: args.history], table, B))
    assert store.save("bench", "s", hist) == "dram", store.tier_of("bench", "s")

    request = Request("r", ids, SamplingParams(max_tokens=1), tenant="bench", session_id="s")
    assert conn.num_external_tokens(request, 0) == args.history  # DRAM lookup, off the clock
    new = ForwardBatch.build(
        [SequenceChunk(ids[args.history :], args.history, table)], B, runner.device
    )

    def no_preload() -> None:
        conn.load(request, 0, args.history, table)
        runner.forward(new)

    def preload() -> None:
        conn.start_load(request, 0, args.history, table)
        runner.forward(new, layer_ready=conn.wait_for_layer)
        errors = conn.finish_loads()
        assert not errors, errors

    def compute() -> None:
        runner.forward(new)

    def load() -> None:
        conn.load(request, 0, args.history, table)

    cases = {"no_preload": no_preload, "preload": preload, "compute": compute, "load": load}
    for fn in cases.values():  # warm-up (and the loader thread started)
        fn()
    reference = runner.forward(new)
    times: dict[str, list[float]] = {name: [] for name in cases}
    wait_before = conn.load_wait_s
    for rep in range(args.reps):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        print(
            f"rep {rep} " + " ".join(f"{n}={times[n][-1] * 1000:.1f}ms" for n in cases),
            file=sys.stderr,
        )
    wait_ms = (conn.load_wait_s - wait_before) * 1000 / args.reps
    conn.start_load(request, 0, args.history, table)  # same logits after a pre-load
    same = torch.equal(runner.forward(new, layer_ready=conn.wait_for_layer), reference)
    conn.finish_loads()
    store.close(flush_dram=False)

    ms = {name: statistics.median(t) * 1000 for name, t in times.items()}
    a, b, c = ms["no_preload"], ms["preload"], ms["compute"]
    hidden = 100 * (a - b) / (a - c) if a > c else 0.0
    result = {
        "model": config.model,
        "layers": spec.num_layers,
        "history_tokens": args.history,
        "new_tokens": args.new,
        "reps": args.reps,
        "layer_delay_ms": args.layer_delay_ms,
        "torch_threads": torch.get_num_threads(),
        "ms_no_preload": round(a, 2),
        "ms_preload": round(b, 2),
        "ms_compute": round(c, 2),
        "ms_load": round(ms["load"], 2),
        "ms_preload_wait": round(wait_ms, 2),
        "preload_logits_equal": same,
        "load_hidden_pct": round(min(100.0, max(0.0, hidden)), 1),
    }
    print(json.dumps(result))


def _history_kv(runner, ids: list[int], table: list[int], B: int) -> torch.Tensor:
    """[L, 2, T, Hkv, D] pre-RoPE K and V of `ids` computed from scratch (through the kv_sink)."""
    spec = runner.spec
    kv = torch.empty((spec.num_layers, 2, len(ids), spec.num_kv_heads, spec.head_dim))

    def sink(layer, k, v, batch) -> None:
        kv[layer, 0] = k.float().cpu()
        kv[layer, 1] = v.float().cpu()

    runner.forward(ForwardBatch.build([SequenceChunk(ids, 0, table)], B, runner.device), sink)
    return kv


if __name__ == "__main__":
    main()
