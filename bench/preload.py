"""Layer-wise pre-load of history KV with a read buffer (CachedAttention §3.2.1, Fig. 19).

Prefill of --new (100) new tokens of a session whose --history (1,000) tokens of KV sit in the
DRAM tier, default model, driving the StoreConnector and ModelRunner.forward directly. Timed:

    no_preload   lookup (DRAM tier read), `load` (every layer into the pool, RoPE re-applied),
                 then the forward: the load entirely on the critical path
    preload_bN   layer-wise pre-load with a read buffer of N layers: before the job (off the
                 clock, as while the previous job runs) the loader thread looks the session up
                 and stages its first N layers rotated; timed: claim the staged entry,
                 start_load, forward(layer_ready=wait_for_layer), finish_loads. N = 0 is no
                 read buffer: the lookup and every layer's copy start with the job.
    compute      the forward alone, the history KV already resident in the pool

Each is timed --reps times, interleaved; medians count. For each N, with per-rep differences,
    hidden_pct_bN = 100 * median(no_preload - preload_bN) / median(no_preload - compute)
(clipped to [0, 100])
is the share of the load time taken off the critical path; `load_hidden_pct` is that of the
largest buffer. `stage_ms_bN` is the staging work moved ahead of the job: on a GPU it runs on
the copy engine beside the previous job; on a CPU host it shares the cores with it.
--layer-delay-ms adds a sleep per layer read from the tier (a tier slower than DRAM).

    python bench/preload.py [--history 1000] [--new 100] [--reps 7] [--buffers 0,5,15]
                            [--layer-delay-ms 0] [--plot-dir bench/out] [--no-progress]

Writes <plot dir>/preload_ms_by_case.png: median ms of each case (and, with --jobs, ms per job of
the job sequence); the title carries the load throughput, history KV bytes / ms_load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import plots, progress  # noqa: E402
from chatstore.config import load_config  # noqa: E402
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk  # noqa: E402
from chatstore.engine.request import Request, SamplingParams  # noqa: E402
from chatstore.engine.runtime import create_runtime  # noqa: E402
from chatstore.store.attention_store import create_store  # noqa: E402
from chatstore.store.session_kv import SessionKV  # noqa: E402
from chatstore.transfer import StoreConnector  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=int, default=1000)
    parser.add_argument("--new", type=int, default=100)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--buffers", default="0,5,15", help="read buffer sizes, in layers")
    parser.add_argument("--layer-delay-ms", type=float, default=0.0)
    parser.add_argument("--jobs", type=int, default=8, help="job sequence through the engine")
    parser.add_argument("--seq-reps", type=int, default=3)
    plots.add_argument(parser)
    progress.add_argument(parser)
    args = parser.parse_args()
    progress.configure(args)
    buffers = [int(b) for b in args.buffers.split(",")]
    data = Path(tempfile.mkdtemp(prefix="chatstore-bench-preload-"))
    config = load_config(overrides={"data_dir": str(data), "enable_prefix_cache": False})
    runtime = create_runtime(config)
    spec, cache, runner = runtime.model.spec, runtime.kv_cache, runtime.runner
    store = create_store(config, spec, runtime.model.fingerprint)
    assert store is not None
    conn = StoreConnector(
        store,
        cache,
        runner.rope,
        layer_delay_s=args.layer_delay_ms / 1000,
        read_buffer_layers=max(buffers),
    )

    g = torch.Generator().manual_seed(0)
    total = args.history + args.new
    ids = torch.randint(10, spec.vocab_size, (total,), generator=g).tolist()
    B = cache.block_size
    table = list(range(-(-total // B)))
    assert len(table) <= cache.num_blocks

    # The history's pre-RoPE KV, as turn 1 would have saved it, put in the DRAM tier.
    hist = SessionKV(ids[: args.history], _history_kv(runner, ids[: args.history], table, B))
    assert store.save("bench", "s", hist) == "dram", store.tier_of("bench", "s")
    new = ForwardBatch.build(
        [SequenceChunk(ids[args.history :], args.history, table)], B, runner.device
    )
    names = itertools.count()

    def request() -> Request:
        rid = f"r{next(names)}"
        return Request(rid, ids, SamplingParams(max_tokens=1), tenant="bench", session_id="s")

    def no_preload() -> None:
        req = request()
        assert conn.num_external_tokens(req, 0) == args.history
        conn.load(req, 0, args.history, table)
        runner.forward(new)
        conn.forget(req.request_id)

    stage_s: dict[int, list[float]] = {n: [] for n in buffers}

    def preload(n: int):
        def run() -> None:
            req = request()
            assert conn.num_external_tokens(req, 0) == args.history
            conn.start_load(req, 0, args.history, table)
            runner.forward(new, layer_ready=conn.wait_for_layer)
            errors = conn.finish_loads()
            assert not errors, errors
            conn.forget(req.request_id)

        def staged_ahead() -> None:  # off the clock: while the previous job would run
            conn.read_buffer.layers = n
            if n:
                t0 = time.perf_counter()
                assert conn.stage("bench", "s")
                _wait_staged(conn, n)
                stage_s[n].append(time.perf_counter() - t0)

        return run, staged_ahead

    def compute() -> None:
        runner.forward(new)

    cases: dict[str, tuple] = {"no_preload": (no_preload, None)}
    for n in buffers:
        cases[f"preload_b{n}"] = preload(n)
    cases["compute"] = (compute, None)
    for fn, before in cases.values():  # warm-up (and the loader thread started)
        if before:
            before()
        fn()
    reference = runner.forward(new)
    times: dict[str, list[float]] = {name: [] for name in cases}
    wait_s: dict[str, float] = dict.fromkeys(cases, 0.0)
    for rep in progress.track(range(args.reps), "preload reps"):
        for name, (fn, before) in cases.items():
            if before:
                before()
            wait0 = conn.load_wait_s
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            wait_s[name] += conn.load_wait_s - wait0
        print(
            f"rep {rep} " + " ".join(f"{n}={times[n][-1] * 1000:.1f}ms" for n in cases),
            file=sys.stderr,
        )
    # Same logits after a pre-load through the largest read buffer.
    cases[f"preload_b{max(buffers)}"][1]()
    req = request()
    conn.num_external_tokens(req, 0)
    conn.start_load(req, 0, args.history, table)
    same = torch.equal(runner.forward(new, layer_ready=conn.wait_for_layer), reference)
    conn.finish_loads()
    conn.forget(req.request_id)

    ms = {name: statistics.median(t) * 1000 for name, t in times.items()}
    a, c = ms["no_preload"], ms["compute"]  # medians, for the record
    result: dict[str, object] = {
        "model": config.model,
        "layers": spec.num_layers,
        "history_tokens": args.history,
        "new_tokens": args.new,
        "reps": args.reps,
        "layer_delay_ms": args.layer_delay_ms,
        "torch_threads": torch.get_num_threads(),
        "ms_no_preload": round(a, 2),
        "ms_compute": round(c, 2),
    }
    # Paired per rep (the cases of one rep ran back to back): drift between reps cancels.
    base = times["no_preload"]
    load_ms = statistics.median(x - y for x, y in zip(base, times["compute"], strict=True))
    result["ms_load"] = round(load_ms * 1000, 2)
    for n in buffers:
        b = ms[f"preload_b{n}"]
        pre = times[f"preload_b{n}"]
        saved_ms = statistics.median(x - y for x, y in zip(base, pre, strict=True))
        hidden = 100 * saved_ms / load_ms if load_ms > 0 else 0.0
        result[f"ms_preload_b{n}"] = round(b, 2)
        result[f"ms_wait_b{n}"] = round(wait_s[f"preload_b{n}"] * 1000 / args.reps, 2)
        result[f"stage_ms_b{n}"] = round(statistics.median(stage_s[n]) * 1000, 2) if n else 0.0
        result[f"hidden_pct_b{n}"] = round(min(100.0, max(0.0, hidden)), 1)
    result["preload_logits_equal"] = same
    if args.jobs:
        result.update(_job_sequence(runtime, store, conn, args, max(buffers)))
    history_bytes = args.history * store.bytes_per_token
    load_gbps = history_bytes / (load_ms * 1e9) if load_ms > 0 else None  # load_ms: seconds
    store.close(flush_dram=False)
    result["load_hidden_pct"] = result[f"hidden_pct_b{max(buffers)}"]
    plot_cases(args.plot_dir, ms, result, load_gbps, args)
    print(json.dumps(result))


def plot_cases(
    plot_dir: Path, ms: dict[str, float], result: dict, load_gbps: float | None, args
) -> Path:
    """Median ms per case (Fig. 19's bars); the job sequence's ms per job beside them."""
    panels = [
        plots.Bars(
            f"one prefill of {args.new} new tokens on {args.history} of history",
            [name.replace("_", " ") for name in ms],
            {"median ms": list(ms.values())},
        )
    ]
    seq = {
        k.removeprefix("seq_ms_per_job_"): v for k, v in result.items() if "seq_ms_per_job_" in k
    }
    if seq:
        title = f"{args.jobs} jobs back to back, one at a time"
        panels.append(
            plots.Bars(title, [_case_label(k) for k in seq], {"median ms": list(seq.values())})
        )
    delay = f", tier +{args.layer_delay_ms:g} ms/layer" if args.layer_delay_ms else ""
    load = (
        "no load time left after compute (noise)" if load_gbps is None else f"{load_gbps:.2f} GB/s"
    )
    return plots.bar_chart(
        plots.plot_path(plot_dir, "preload", "ms_by_case"),
        panels,
        title=f"preload: layer-wise pre-load with a read buffer{delay}; "
        f"history load on the critical path (no pre-load): {load}",
        ylabel="ms (median)",
    )


def _case_label(mode: str) -> str:
    return mode.replace("_", " ") if mode.startswith("no_") else f"preload {mode}"


def _job_sequence(runtime, store, conn: StoreConnector, args, buffer: int) -> dict[str, float]:
    """--jobs sessions' next turns queued at once through LLMEngine, one job at a time
    (max_running = 1): the read buffer stages the next job while the current one computes, so
    the staging is on the clock here, sharing the machine with the running job."""
    from chatstore.engine.engine_config import EngineConfig
    from chatstore.engine.llm_engine import LLMEngine

    spec, cache, runner = runtime.model.spec, runtime.kv_cache, runtime.runner
    g = torch.Generator().manual_seed(1)
    total = args.history + args.new
    table = list(range(-(-args.history // cache.block_size)))
    prompts, saved = {}, {}
    for j in range(args.jobs):
        ids = torch.randint(10, spec.vocab_size, (total,), generator=g).tolist()
        prompts[f"j{j}"] = ids
        kv = _history_kv(runner, ids[: args.history], table, cache.block_size)
        saved[f"j{j}"] = SessionKV(ids[: args.history], kv)
    config = EngineConfig(enable_prefix_cache=False, max_running=1, max_tokens_per_step=2048)
    engine = LLMEngine(runtime, config, conn)
    conn.stage_queued = True  # on a CPU host the default stages hinted sessions only
    names = itertools.count()
    modes = {"no_preload": (False, 0), "b0": (True, 0), f"b{buffer}": (True, buffer)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in progress.track(range(args.seq_reps + 1), "job sequence reps"):  # rep 0 warms up
        for mode, (layerwise, layers) in modes.items():
            for sid, value in saved.items():  # every job finds its 1K history in DRAM
                store.save("bench", sid, value)
            conn.read_buffer.layers = layers
            conn.layerwise = layerwise  # False: the engine calls load(), all before the forward
            t0 = time.perf_counter()
            for sid, ids in prompts.items():
                params = SamplingParams(max_tokens=1)
                engine.add_request(
                    Request(f"q{next(names)}", ids, params, tenant="bench", session_id=sid)
                )
            while engine.has_work():
                engine.step()
            if rep:
                times[mode].append((time.perf_counter() - t0) / args.jobs)
        store.flush_writes()
    del conn.layerwise  # the class's again
    ms = {m: statistics.median(t) * 1000 for m, t in times.items()}
    out = {f"seq_ms_per_job_{m}": round(v, 2) for m, v in ms.items()}
    out["seq_jobs"] = args.jobs
    out[f"seq_speedup_b{buffer}"] = round(ms["no_preload"] / ms[f"b{buffer}"], 3)
    return out


def _wait_staged(conn: StoreConnector, layers: int) -> None:
    from chatstore.store.session_kv import SessionKey

    entry = conn.read_buffer._entries.get(SessionKey("bench", "s"))
    assert entry is not None, "nothing staged"
    while entry.num_staged_layers < layers and not entry.cancelled:
        time.sleep(0.0005)


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
