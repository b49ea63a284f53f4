"""The device check of issue 34: one command that measures chatstore's GPU path.

    python bench/gpu_check.py [--device cuda] [--quick] [--out DIR]

Random weights in two shapes (no model file travels): SmolLM2-135M (30 layers, hidden 576,
9 q / 3 KV heads) and Llama-3.2-1B (16 layers, hidden 2048, 32 / 8 heads); `--quick` shrinks
both to 2 layers and short contexts so `--device cpu --quick` runs the same code end to end on a
CPU in CI (tests/bench/test_gpu_check.py). Every file it writes (the store's DRAM/LMDB data,
Triton's cache) lies under --out. The last line printed is one JSON object:

    gpu_name, torch_version, h2d_pinned_gbps, d2h_pinned_gbps, d2d_gbps   (null on a CPU)
    gpu_exact_ok        fp32, SmolLM2 shape: logits within EXACT_TOL of transformers, and the
                        same 64 greedy tokens (16 with --quick) as transformers fresh, and on a
                        second turn whose history comes back from DRAM, and from LMDB
    gpu_decode_b1_tok_s, gpu_decode_b32_tok_s   bf16 (fp32 on a CPU) eager decode at 512 and
                        2K context, runner.forward per step (batch built, sampling left out)
    gpu_decode_b1_tok_s_graph, gpu_decode_b32_tok_s_graph   the same steps through the decode
                        graphs (cuda_graphs.py: buffers filled, bucket replayed; on a CPU the
                        same path without capture), gpu_graph_speedup_b1 = graph / eager at b1
    gpu_decode_b1_roofline_pct   tok/s at batch 1, 512 context, over d2d_gbps / bytes a step
                        reads (weights + KV); null on a CPU; ..._graph: the same for the
                        graph path (what the engine serves on CUDA)
    gpu_prefill_2k_tok_s one 2,048-token prompt
    gpu_load_hidden_pct  100 new tokens on a 4K history loaded layer by layer from DRAM: share
                        of the load time (serial load + forward - resident forward) hidden
    llama1b             the speed keys for the Llama-3.2-1B shape; errors: section -> message

The store is built with encryption at rest off: sealing is the store's CPU work, not the device
path measured here, and its key file would live outside --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def output_folder() -> Path:
    """--out (or a new temporary folder), read before torch is imported: every cache a library
    would keep in the home or temp folder (Triton's, inductor's, the native CPU kernels') is
    pointed into it first."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--out", type=Path)
    args, _ = early.parse_known_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    for var, sub in (
        ("TRITON_CACHE_DIR", "triton-cache"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor-cache"),
        ("CHATSTORE_KERNEL_CACHE", "kernel-cache"),
    ):
        os.environ[var] = str(out / sub)
    return out


def kernels_from_tree() -> None:
    """Where chatstore is not installed (the tree copied to a GPU machine and run from there),
    map `chatstore.kernels` onto kernels/ as pyproject's package-dir does for an install."""
    import importlib.util

    import chatstore

    if importlib.util.find_spec("chatstore.kernels") is not None:
        return
    init = ROOT / "kernels" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "chatstore.kernels", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chatstore.kernels"] = module
    spec.loader.exec_module(module)
    chatstore.kernels = module  # type: ignore[attr-defined]


OUT = output_folder()
kernels_from_tree()

import torch  # noqa: E402

from chatstore.engine.block_pool import BlockPool  # noqa: E402
from chatstore.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from chatstore.engine.engine_config import EngineConfig  # noqa: E402
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk  # noqa: E402
from chatstore.engine.kv_cache import PagedKVCache  # noqa: E402
from chatstore.engine.llm_engine import LLMEngine  # noqa: E402
from chatstore.engine.request import Request, SamplingParams  # noqa: E402
from chatstore.engine.runner import ModelRunner  # noqa: E402
from chatstore.engine.runtime import Runtime  # noqa: E402
from chatstore.model import LoadedModel  # noqa: E402
from chatstore.model.spec import ModelSpec  # noqa: E402
from chatstore.model.weights import TransformersWeights  # noqa: E402
from chatstore.store.attention_store import AttentionStore  # noqa: E402
from chatstore.store.session_kv import SessionKV  # noqa: E402
from chatstore.store.settings import StoreSettings  # noqa: E402
from chatstore.transfer import StoreConnector  # noqa: E402

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    rope_theta=100000.0),
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    rope_theta=500000.0),
}  # fmt: skip
# --quick: the same heads (GQA 3 and 4, head dim 64), 2 layers, a narrow MLP, a small vocabulary.
QUICK = dict(num_hidden_layers=2, intermediate_size=256, vocab_size=512)
EXACT_TOL = 1e-3  # fp32 logits; the CPU runner meets 3e-4 on the real 30-layer model
GREEDY_TOKENS = 64  # --quick: 16
BLOCK = 16


class Check:
    """Sizes of one run: full (a GPU) or --quick (CI on a CPU)."""

    def __init__(self, device: str, quick: bool, out: Path) -> None:
        self.device, self.quick, self.out = torch.device(device), quick, out
        self.speed_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.contexts = (32, 64) if quick else (512, 2048)
        self.batches = (1, 32)
        self.steps = 3 if quick else 32
        self.prompt = 24 if quick else 256
        self.greedy = 16 if quick else GREEDY_TOKENS
        self.prefill = 64 if quick else 2048
        self.history, self.new = (64, 8) if quick else (4096, 100)
        self.errors: dict[str, str] = {}
        self.seconds: dict[str, float] = {}  # wall time of each section (the 6-minute budget)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], object], reps: int) -> float:
        """Median seconds of `reps` calls after one warm-up (which compiles Triton kernels)."""
        fn()
        times = []
        for _ in range(reps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def section(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """One measured part; a failure is recorded under `errors` and the rest still runs."""
        t0 = time.perf_counter()
        part: dict[str, Any] = {}
        try:
            part = fn()
            return part
        except Exception as exc:  # a device check reports what broke, then goes on
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
            return {}
        finally:
            self.seconds[name] = round(time.perf_counter() - t0, 1)
            # Each section's keys as soon as it ends: a run cut short by its time limit (a
            # device lease is minutes) still reports what it measured.
            print(f"section {name} ({self.seconds[name]} s): {json.dumps(part)}", file=sys.stderr)


def runtime(check: Check, shape: str, dtype: torch.dtype, tokens: int) -> Runtime:
    """Random weights (seed 0) of `shape` and a paged pool of `tokens` slots."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=1e-5)
    kwargs.update(QUICK if check.quick else {})
    torch.manual_seed(0)
    with check.device:
        hf = LlamaForCausalLM(LlamaConfig(**kwargs, tie_word_embeddings=False)).to(dtype).eval()
    spec = ModelSpec.from_hf_config(hf.config)
    num_blocks = -(-tokens // BLOCK) + 4
    kv = PagedKVCache(spec, num_blocks, BLOCK, dtype, check.device)
    fingerprint = f"random-{shape}-{dtype}"
    model = LoadedModel(TransformersWeights(hf), None, spec, Path("."), dtype, fingerprint)
    return Runtime(model, kv, BlockPool(num_blocks), ModelRunner(hf, spec, kv))


def bandwidth(check: Check) -> dict[str, Any]:
    """Pinned host <-> device and device-to-device copy rates (GB/s, bytes moved once)."""
    if check.device.type != "cuda":
        return dict(h2d_pinned_gbps=None, d2h_pinned_gbps=None, d2d_gbps=None)
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev, dev2 = (
        torch.empty(n, dtype=torch.uint8, device="cuda"),
        torch.empty_like(host, device="cuda"),
    )
    rate = lambda fn: round(n / check.timed(fn, 5) / 1e9, 2)  # noqa: E731
    return dict(
        h2d_pinned_gbps=rate(lambda: dev.copy_(host, non_blocking=True)),
        d2h_pinned_gbps=rate(lambda: host.copy_(dev, non_blocking=True)),
        # A copy reads and writes n bytes each: the bandwidth a decode step's reads can use.
        d2d_gbps=round(2 * n / check.timed(lambda: dev2.copy_(dev), 5) / 1e9, 2),
    )


def open_store(check: Check, rt: Runtime, name: str, **settings: Any) -> AttentionStore:
    """A store of DRAM and LMDB tiers under --out (no Redis; sealing off, see the docstring)."""
    data_dir = check.out / f"store-{name}"
    kw = dict(ssd_bytes=1 << 30, block_size=BLOCK, encrypt_at_rest=False, **settings)
    return AttentionStore(StoreSettings(data_dir, **kw), rt.model.spec, rt.model.fingerprint)


def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy tokens (its KV cache, its attention)."""
    with torch.no_grad():
        out = hf(torch.tensor([ids], device=hf.device), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(n - 1):
            step = torch.tensor([[tokens[-1]]], device=hf.device)
            out = hf(step, past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def run_turn(
    check: Check, engine: LLMEngine, store: AttentionStore, ids: list[int], turn: str
) -> tuple:
    """One greedy turn of session "s": its tokens and where its cached history came from."""
    opened = store.open_turn("gpu-check", "s")
    params = SamplingParams(max_tokens=check.greedy, temperature=0.0, ignore_eos=True)
    request = Request(turn, ids, params, tenant="gpu-check", session_id="s", store_turn=opened)
    engine.add_request(request)
    tokens: list[int] = []
    usage = None
    while engine.has_work():
        for out in engine.step():
            tokens += [t for s in out.samples for t in s.token_ids]
            usage = out.usage or usage
    assert usage is not None
    # the engine's "store" share, by the tier each chunk was in (read from the turn's handle)
    start = usage.cached_by_tier.get("device", 0)
    return tokens, opened.tokens_by_origin(start, start + usage.cached_by_tier.get("store", 0))


def exactness(check: Check) -> dict[str, Any]:
    rt = runtime(check, "smollm2", torch.float32, 4 * (check.prompt + 3 * check.greedy))
    hf, runner = rt.model.weights.model, rt.runner  # TransformersWeights' random model
    ids = torch.randint(2, rt.model.spec.vocab_size, (check.prompt + 16,)).tolist()
    prompt, user = ids[: check.prompt], ids[check.prompt :]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device=check.device)).logits[0].float()
    table = list(range(-(-len(prompt) // BLOCK)))
    ours = runner.forward(
        ForwardBatch.build([SequenceChunk(prompt, 0, table)], BLOCK, check.device, all_logits=True)
    )
    diff = float((ours - ref).abs().max())
    first = hf_greedy(hf, prompt, check.greedy)
    result: dict[str, Any] = {"gpu_max_logit_diff": diff, "greedy_equal": {}}
    for tier, dram in (("dram", 1 << 30), ("ssd", 0)):
        store = open_store(check, rt, tier, dram_bytes=dram)
        engine = LLMEngine(
            rt,
            EngineConfig(enable_prefix_cache=False),
            StoreConnector(store, rt.kv_cache, runner.rope),
        )
        got, _ = run_turn(check, engine, store, prompt, f"{tier}-1")
        result["greedy_equal"]["fresh" if tier == "dram" else "fresh_ssd"] = got == first
        store.flush_writes(30)
        second = [*prompt, *got, *user]
        got2, cached = run_turn(check, engine, store, second, f"{tier}-2")
        restored = cached.get(tier, 0) >= len(prompt)
        result["greedy_equal"][tier] = restored and got2 == hf_greedy(hf, second, check.greedy)
        store.close()
    result["gpu_exact_ok"] = diff <= EXACT_TOL and all(result["greedy_equal"].values())
    return result


def decode_speed(
    check: Check, rt: Runtime, batch: int, context: int, graphs: DecodeGraphs | None = None
) -> float:
    """Tokens a second of `batch` sequences decoding at `context` tokens, one step a call:
    eager, or through `graphs` (replayed on CUDA)."""
    per_seq = -(-(context + 1) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    chunks = [SequenceChunk([7], context, t) for t in tables]

    def step() -> None:
        rt.runner.forward(ForwardBatch.build(chunks, BLOCK, check.device)).argmax(-1)

    def replay() -> None:
        assert graphs is not None and graphs.accepts(chunks)
        graphs.run(chunks, None, None).argmax(-1)

    return batch / check.timed(step if graphs is None else replay, check.steps)


def decode_graphs(check: Check, rt: Runtime) -> DecodeGraphs:
    """Graphs for every bucket up to the largest batch, captured on CUDA; padding rows write
    to the pool's last block, which no decode table here reaches."""
    max_blocks = -(-(max(check.contexts) + 1) // BLOCK)
    scratch = rt.kv_cache.num_blocks - 1
    capture = check.device.type == "cuda"
    return DecodeGraphs(rt.runner, max(check.batches), max_blocks, scratch, False, capture)


def speeds(check: Check, shape: str) -> dict[str, Any]:
    big = max(check.batches) * (max(check.contexts) + BLOCK)
    rt = runtime(check, shape, check.speed_dtype, max(big, check.prefill + BLOCK))
    out: dict[str, Any] = {}
    for batch in check.batches:
        for context in check.contexts:
            tok_s = decode_speed(check, rt, batch, context)
            out[f"gpu_decode_b{batch}_ctx{context}_tok_s"] = round(tok_s, 1)
    out["gpu_decode_b1_tok_s"] = out[f"gpu_decode_b1_ctx{check.contexts[0]}_tok_s"]
    out["gpu_decode_b32_tok_s"] = out[f"gpu_decode_b32_ctx{check.contexts[0]}_tok_s"]
    t0 = time.perf_counter()
    graphs = decode_graphs(check, rt)
    out["graph_capture_s"] = round(time.perf_counter() - t0, 1)
    for batch in check.batches:
        for context in check.contexts:
            tok_s = decode_speed(check, rt, batch, context, graphs)
            out[f"gpu_decode_b{batch}_ctx{context}_tok_s_graph"] = round(tok_s, 1)
    out["gpu_decode_b1_tok_s_graph"] = out[f"gpu_decode_b1_ctx{check.contexts[0]}_tok_s_graph"]
    out["gpu_decode_b32_tok_s_graph"] = out[f"gpu_decode_b32_ctx{check.contexts[0]}_tok_s_graph"]
    out["gpu_graph_speedup_b1"] = round(
        out["gpu_decode_b1_tok_s_graph"] / out["gpu_decode_b1_tok_s"], 2
    )
    del graphs  # its memory pool goes back before the prefill
    params = sum(
        p.numel() * p.element_size()
        for n, p in rt.model.weights.model.named_parameters()
        if "embed" not in n
    )
    kv_bytes = rt.kv_cache.nbytes // (rt.kv_cache.num_blocks * BLOCK) * check.contexts[0]
    out["bytes_per_b1_step"] = params + kv_bytes
    prompt = list(range(2, check.prefill + 2))
    table = list(range(-(-check.prefill // BLOCK)))
    prefill = ForwardBatch.build([SequenceChunk(prompt, 0, table)], BLOCK, check.device)
    out["gpu_prefill_2k_tok_s"] = round(
        check.prefill / check.timed(lambda: rt.runner.forward(prefill), 3), 1
    )
    return out


def load_hidden(check: Check) -> dict[str, Any]:
    """Serial load + forward vs layer-wise load overlapped with the forward vs resident."""
    total = check.history + check.new
    rt = runtime(check, "smollm2", check.speed_dtype, total + BLOCK)
    spec, runner = rt.model.spec, rt.runner
    ids = torch.randint(2, spec.vocab_size, (total,)).tolist()
    table = list(range(-(-total // BLOCK)))
    kv = torch.empty((spec.num_layers, 2, check.history, spec.num_kv_heads, spec.head_dim))

    def sink(layer: int, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
        kv[layer, 0], kv[layer, 1] = k.float().cpu(), v.float().cpu()

    runner.forward(
        ForwardBatch.build([SequenceChunk(ids[: check.history], 0, table)], BLOCK, check.device),
        sink,
    )
    store = open_store(check, rt, "load", dram_bytes=4 << 30, storage_dtype=check.speed_dtype)
    assert store.save("gpu-check", "h", SessionKV(ids[: check.history], kv)) == "dram"
    conn = StoreConnector(store, rt.kv_cache, runner.rope)
    new = ForwardBatch.build(
        [SequenceChunk(ids[check.history :], check.history, table)], BLOCK, check.device
    )
    names = iter(range(1 << 30))

    def request() -> Request:
        params = SamplingParams(max_tokens=1)
        return Request(f"r{next(names)}", ids, params, tenant="gpu-check", session_id="h")

    def serial() -> None:
        req = request()
        assert conn.num_external_tokens(req, 0) == check.history
        conn.load(req, 0, check.history, table)
        runner.forward(new)
        conn.forget(req.request_id)

    def layerwise() -> None:
        req = request()
        assert conn.num_external_tokens(req, 0) == check.history
        conn.start_load(req, 0, check.history, table)
        runner.forward(new, layer_ready=conn.wait_for_layer)
        assert not conn.finish_loads()
        conn.forget(req.request_id)

    reps = 3 if check.quick else 7
    t_serial, t_layer = check.timed(serial, reps), check.timed(layerwise, reps)
    t_resident = check.timed(lambda: runner.forward(new), reps)
    times = dict(serial=t_serial, layerwise=t_layer, resident=t_resident)
    store.close(flush_dram=False)
    load = t_serial - t_resident
    hidden = 100 * (t_serial - t_layer) / load if load > 0 else None
    return dict(
        gpu_load_hidden_pct=None if hidden is None else round(min(100.0, max(0.0, hidden)), 1),
        load_ms={k: round(t * 1e3, 2) for k, t in times.items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CI on a CPU)")
    parser.add_argument("--out", type=Path, help="output folder (default: a new temporary one)")
    args = parser.parse_args()
    check = Check(args.device, args.quick, OUT)
    t0 = time.perf_counter()
    cuda = check.device.type == "cuda"
    result: dict[str, Any] = {
        "gpu_name": torch.cuda.get_device_name() if cuda else None,
        "torch_version": torch.__version__,
        "device": args.device,
        "quick": args.quick,
        "out": str(OUT),
        "dtype": str(check.speed_dtype).removeprefix("torch."),
    }
    result.update(check.section("bandwidth", lambda: bandwidth(check)))
    result.update(check.section("exactness", lambda: exactness(check)))
    result.update(check.section("speed_smollm2", lambda: speeds(check, "smollm2")))
    result["llama1b"] = check.section("speed_llama1b", lambda: speeds(check, "llama1b"))
    for key in ("gpu_decode_b1_tok_s_graph", "gpu_decode_b32_tok_s_graph", "gpu_graph_speedup_b1"):
        result.setdefault(key, None)  # null when the section failed
    for part in (result, result["llama1b"]):
        step = part.get("bytes_per_b1_step")
        if cuda and step and result.get("d2d_gbps"):
            ceiling = result["d2d_gbps"] * 1e9 / step
            part["gpu_decode_b1_roofline_pct"] = round(
                100 * part["gpu_decode_b1_tok_s"] / ceiling, 1
            )
            # What the engine serves on CUDA (graphs on by default), against the same ceiling.
            graph = part.get("gpu_decode_b1_tok_s_graph")
            part["gpu_decode_b1_roofline_pct_graph"] = (
                round(100 * graph / ceiling, 1) if graph else None
            )
        else:
            part["gpu_decode_b1_roofline_pct"] = None
            part["gpu_decode_b1_roofline_pct_graph"] = None
    result.update(check.section("load_hidden", lambda: load_hidden(check)))
    result["errors"] = check.errors
    result["section_s"] = check.seconds
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
