"""CPU at the hardware limit (issue 25, item 6): quantized weights against bf16 and llama.cpp.

    in process   our engine's runner with bf16, int8 and int4 (the GGUF's own codes: `weights =
                 auto`) weights: prefill tok/s of 2,000 tokens as served (the prefill weights
                 `auto` picks), then decode tok/s at batch 1 / 8 / 32 from a 512-token context
                 on the quantized kernels at every batch (as served, batch 32 would run on the
                 16-bit copy: `decode_b32_int8_vs_bf16` would compare two dense runs); medians
    served       `chatstore serve --weights W` for bf16 and int4, then llama.cpp's server
                 (`../shared/peers/llamacpp/serve.sh`, the same GGUF file, THREADS = this
                 process's torch threads), one at a time, the same streaming client
                 (peer_servers' prompts, EOS banned): decode at batch 1 (128 tokens; tok/s
                 from the first token to the last) and the prefill of a fresh ~2,000-token
                 prompt (prompt tokens / TTFT; llama-cpp-python streams no usage: its prompt
                 is counted with the same tokenizer and template); medians
    accuracy     bench/quant_accuracy.py (ppl_int8_pct, ppl_int4_gguf_pct, greedy agreement)
    store        bench/quant_kv.py's measure_kv (kv_bytes_ratio_int8, restore_ttft_ratio_int8kv,
                 ppl_int8kv_pct), where that module is present

    python bench/quant.py [--quick] [--no-llamacpp]

Last line: JSON with decode_b1_int4_vs_llamacpp (served), decode_b1_int4_vs_bf16 and
decode_b32_int8_vs_bf16 (in process), prefill_2k_vs_llamacpp (served, weights = auto),
ppl_int8_pct, the store's keys, and the CPU model, its avx512_bf16 flag and the dtype. Run it
on an idle machine: nothing else may run beside it. --quick: the smallest sizes (a smoke run;
its numbers mean nothing), llama.cpp only if its venv is built.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
import torch  # noqa: E402
from engine_speed import DECODE_CONTEXT, Ours, median_seconds  # noqa: E402
from peer_servers import (  # noqa: E402
    BAN_EOS,
    MODEL_NAME,
    PromptMaker,
    ServerProcess,
    decode_prompts,
    free_port,
)
from quant_accuracy import measure_weights_accuracy  # noqa: E402

from bench.machine import machine_report  # noqa: E402
from chatstore.config import cpu_has_fast_bf16, resolve_dtype  # noqa: E402
from chatstore.engine.linear import packing_available  # noqa: E402
from chatstore.engine.quant_linear import NEVER, int4_kernel  # noqa: E402
from chatstore.engine.runner import ModelRunner  # noqa: E402
from chatstore.engine.weight_plan import Projections, prefill_mode  # noqa: E402
from chatstore.model import LoadedModel, load_model  # noqa: E402
from chatstore.model.gguf_weights import GGUFWeights  # noqa: E402

PEERS = ROOT.parent / "shared" / "peers" / "llamacpp"
FORMATS = {"bf16": "dense", "int8": "int8", "int4": "gguf"}
FULL = {"batches": (1, 8, 32), "steps": 32, "prefill": 2000, "reps": 5, "served_tokens": 128}
QUICK = {"batches": (1, 8), "steps": 2, "prefill": 64, "reps": 1, "served_tokens": 8}


def in_process(model: LoadedModel, fmt: str, sizes: dict) -> dict[str, float]:
    ours = Ours(model, DECODE_CONTEXT * 33 + sizes["prefill"])
    if fmt != "dense":
        gguf = GGUFWeights(model.gguf, model.spec)
        pack = packing_available(torch.device("cpu"), model.dtype)
        projections = Projections(
            fmt,
            model.dtype,
            pack,
            gguf,
            tied_head=model.spec.tie_word_embeddings,
            prefill=prefill_mode("auto", model.spec, model.dtype),
        )  # as served: the prefill weights auto picks
        ours.runner = ModelRunner(model.weights, model.spec, ours.kv, "auto", projections)
    out = {}
    with torch.inference_mode():
        ids = torch.randint(0, model.spec.vocab_size, (sizes["prefill"],)).tolist()
        table = ours.blocks(len(ids))
        seconds = median_seconds(lambda: ours.prefill(ids, table), sizes["reps"])
        out["prefill"] = len(ids) / seconds
        ours.pool.free(table)
        if fmt != "dense":  # decode on the quantized kernels at every batch (see the doc)
            for layer in ours.runner.layers:
                for proj in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                    proj.dense_from = NEVER  # type: ignore[union-attr]
        for batch in sizes["batches"]:
            out[f"decode_b{batch}"] = decode_speed(model, ours, batch, sizes)
    return out


def decode_speed(model: LoadedModel, ours: Ours, batch: int, sizes: dict) -> float:
    """tok/s of `steps` greedy steps of `batch` sequences on one 512-token context."""
    steps = sizes["steps"]
    ids = torch.randint(0, model.spec.vocab_size, (DECODE_CONTEXT,)).tolist()
    src = ours.blocks(DECODE_CONTEXT + steps)
    first = int(ours.prefill(ids, src).argmax(-1))
    tables = [ours.blocks(DECODE_CONTEXT + steps) for _ in range(batch)]
    for table in tables:
        for s, d in zip(src, table, strict=True):
            ours.kv.copy_block(s, d)
    run = lambda: ours.decode_loop(tables, [first] * batch, steps)  # noqa: E731
    seconds = median_seconds(run, sizes["reps"], 1)
    for table in [src, *tables]:
        ours.pool.free(table)
    return batch * steps / seconds


def chatstore_served(weights: str, log_dir: Path) -> ServerProcess:
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="chatstore-bench-quant-"))
    argv = [sys.executable, "-m", "chatstore", "serve", "--port", str(port)]
    argv += ["--data-dir", str(data), "--weights", weights]
    env = {**os.environ, "CHATSTORE_API_KEYS": "", "CHATSTORE_ADMIN_KEY": ""}
    env.pop("CHATSTORE_DTYPE", None)  # dtype = auto: the compute dtype this CPU serves
    log = log_dir / f"chatstore-{weights}.log"
    return ServerProcess(f"chatstore {weights}", argv, env, port, "/readyz", log, 300)


def llamacpp_ready() -> bool:
    home = Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "chatstore-peers"))
    python = home / "llamacpp" / "venv" / "bin" / "python"
    if not python.is_file() or not (PEERS / "serve.sh").is_file():
        return False
    return os.system(f"{python} -c 'import llama_cpp.server' >/dev/null 2>&1") == 0


def llamacpp_served(log_dir: Path) -> ServerProcess:
    port = free_port()
    home = os.environ.get("PEERS_HOME", str(Path.home() / ".cache" / "chatstore-peers"))
    threads = str(torch.get_num_threads())
    env = {**os.environ, "PEERS_HOME": home, "CHECKOUT": str(ROOT), "THREADS": threads}
    env["VERBOSE"] = "False"
    argv = ["bash", str(PEERS / "serve.sh"), "default", str(port)]
    return ServerProcess("llama.cpp", argv, env, port, "/v1/models", log_dir / "llama.log", 300)


def timed_stream(http: httpx.Client, url: str, messages: list, max_tokens: int) -> Timed:
    """One streaming request, EOS banned. Tokens counted from usage where the server sends it,
    else one per content chunk (llama-cpp-python streams a token a chunk and no usage)."""
    body = {
        "model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "logit_bias": BAN_EOS,
    }  # fmt: skip
    sent, stamps, usage = time.perf_counter(), [], None
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{url}: the stream carried no token")
    tokens = usage["completion_tokens"] if usage else len(stamps)
    prompt = usage["prompt_tokens"] if usage else None
    return Timed(stamps[0] - sent, stamps[-1] - stamps[0], tokens, prompt)


class Timed(NamedTuple):
    ttft: float  # request sent -> first token
    decode_s: float  # first token -> last token
    tokens: int
    prompt_tokens: int | None  # None where the server sends no usage


def served(server: ServerProcess, maker: PromptMaker, sizes: dict) -> dict[str, float]:
    """Batch-1 decode and a fresh prefill over HTTP, after a warm-up of both."""
    prompts = [maker.fresh_prompt(f"quant-{i}", sizes["prefill"]) for i in range(sizes["reps"])]
    with server, httpx.Client(trust_env=False, timeout=600) as http:
        url = server.url
        timed_stream(http, url, maker.fresh_prompt("warm-up", sizes["prefill"]), 8)
        fills = [timed_stream(http, url, p, 1) for p in prompts]
        story = [decode_prompts(1, rep)[0] for rep in range(sizes["reps"])]
        decodes = [timed_stream(http, url, m, sizes["served_tokens"]) for m in story]
    counts = [t.prompt_tokens or maker.count(p) for t, p in zip(fills, prompts, strict=True)]
    return {
        "prefill": statistics.median(n / t.ttft for n, t in zip(counts, fills, strict=True)),
        "prefill_tokens": counts[0],
        "decode_b1": statistics.median((t.tokens - 1) / t.decode_s for t in decodes),
    }


def store_keys(quick: bool) -> dict:
    if importlib.util.find_spec("quant_kv") is None:
        print("bench/quant_kv.py is missing: no store keys", file=sys.stderr)
        return {}
    from quant_kv import measure_kv

    return measure_kv(quick)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: a smoke run only")
    parser.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    dtype = resolve_dtype("auto")
    model = load_model(dtype=getattr(torch, dtype))
    ours = {name: in_process(model, fmt, sizes) for name, fmt in FORMATS.items()}
    for name, speeds in ours.items():
        print(f"in process {name}: " + json.dumps({k: round(v, 1) for k, v in speeds.items()}))
    log_dir = Path(tempfile.mkdtemp(prefix="chatstore-bench-quant-logs-"))
    maker = PromptMaker(model.tokenizer)
    http = {w: served(chatstore_served(w, log_dir), maker, sizes) for w in ("bf16", "auto")}
    use_llama = not args.no_llamacpp and llamacpp_ready()
    if use_llama:
        http["llamacpp"] = served(llamacpp_served(log_dir), maker, sizes)
    elif not args.no_llamacpp:
        print(f"llama.cpp is not built (bash {PEERS}/setup.sh): left out", file=sys.stderr)
    for name, speeds in http.items():
        print(f"served {name}: " + json.dumps({k: round(v, 1) for k, v in speeds.items()}))
    llama = http.get("llamacpp", {})
    result = {
        "decode_b1_int4_vs_llamacpp": ratio(http["auto"]["decode_b1"], llama.get("decode_b1")),
        "decode_b1_int4_vs_bf16": ratio(ours["int4"]["decode_b1"], ours["bf16"]["decode_b1"]),
        "decode_b32_int8_vs_bf16": ratio(
            ours["int8"].get("decode_b32"), ours["bf16"].get("decode_b32")
        ),
        "prefill_2k_vs_llamacpp": ratio(http["auto"]["prefill"], llama.get("prefill")),
        "decode_b1_int4_vs_bf16_served": ratio(
            http["auto"]["decode_b1"], http["bf16"]["decode_b1"]
        ),
    }
    accuracy = measure_weights_accuracy(args.quick)
    result |= {"ppl_int8_pct": accuracy["ppl_int8_pct"]}
    result |= {"ppl_int4_gguf_pct": accuracy["ppl_int4_gguf_pct"]}
    store = store_keys(args.quick)
    for key in ("ppl_int8kv_pct", "kv_bytes_ratio_int8", "restore_ttft_ratio_int8kv"):
        result[key] = store.get(key)
    result |= machine_report() | {"int4_kernel": int4_kernel()}
    result |= {
        "avx512_bf16": cpu_has_fast_bf16(),
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "quick": args.quick,
        "in_process_tok_s": {n: {k: round(v, 1) for k, v in s.items()} for n, s in ours.items()},
        "served_tok_s": {n: {k: round(v, 1) for k, v in s.items()} for n, s in http.items()},
        "accuracy": accuracy,
        "store": store,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
