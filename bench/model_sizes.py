"""Real model sizes on a CPU (issue 35 item 5): chatstore and llama.cpp's server on the same GGUF.

Random-weight Q4_0 GGUFs in the shapes of Llama-3.2-1B (16 layers, hidden 2,048, GQA 32/8, FFN
8,192, tied embeddings) and Llama-3.1-8B (32 layers, hidden 4,096, GQA 32/8, FFN 14,336, an
untied output), with the embedded model's tokenizer and chat template (vocabulary 49,152, so the
embeddings are smaller than Llama's 128K), every 2-D tensor Q4_0 (llama.cpp's `--pure`), norms
F32. Written once under `$CHATSTORE_HOME/bench-models/` (how long writing took is printed).
Random codes with a scale of ~1/sqrt(K) keep activations finite; the text they produce means
nothing, the speeds and bytes do. `--shapes 135m` adds the embedded model's own GGUF.

For each shape, one server at a time, the same streaming client (bench/quant.py's: EOS banned):

    load_s           process start -> the first token of a short request (the tokenizer's
                     one-time conversion cached beforehand by an unmeasured start)
    peak_rss_mb      the server process's VmHWM after everything below; steady_rss_mb its VmRSS
                     (and both over the file's size + chatstore's 1 GiB KV pool)
    decode_b1        tok/s from the first token to the last of a long reply, batch 1
    prefill_2k       prompt tokens / TTFT of a fresh ~2,000-token prompt

chatstore runs `chatstore serve --model FILE` with its defaults (`weights = auto`: the file's
Q4_0 as it is; `prefill_weights = auto`: expanded just in time when the 16-bit copies would take
over 1 GiB); llama.cpp `../shared/peers/llamacpp/serve.sh` with `MODEL=FILE`, its threads = this
process's torch threads. Ratios chatstore / llama.cpp; last line one JSON object.

On a VM whose CPU flags list AMX but whose kernel does not grant it (this project's Xeon),
setup.sh's GGML_NATIVE build emits AMX tile instructions and the server dies of SIGILL on its
first batched prompt; build it with the ISA named instead:
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON" bash setup.sh

    python bench/model_sizes.py [--shapes 1b,8b] [--no-llamacpp] [--reps 2]
"""

from __future__ import annotations

import argparse
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
import numpy as np  # noqa: E402
from peer_servers import PromptMaker, ServerProcess, decode_prompts, free_port  # noqa: E402
from quant import PEERS, llamacpp_ready, ratio, timed_stream  # noqa: E402

from bench.machine import machine_report, proc_status_mb  # noqa: E402


class Shape(NamedTuple):
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool


SHAPES = {
    "1b": Shape(16, 2048, 32, 8, 8192, True),  # Llama-3.2-1B
    "8b": Shape(32, 4096, 32, 8, 14336, False),  # Llama-3.1-8B
}
Q4_0_BYTES, Q4_0_VALUES = 18, 32
KV_POOL_BYTES = 1 << 30  # chatstore's device KV pool (its default), in the RSS ratios


def default_gguf() -> Path:
    from chatstore.model.default_model import gguf_path

    return gguf_path()


def models_dir() -> Path:
    from chatstore.model.default_model import chatstore_home

    return chatstore_home() / "bench-models"


def _q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks [rows, cols / 32 * 18]: random codes, f16 scale ~1/(4.6 sqrt(cols))
    (codes uniform over 0..15 have a spread of ~4.6 steps: weights of std ~1/sqrt(K))."""
    blocks = rng.integers(0, 256, (rows, cols // Q4_0_VALUES, Q4_0_BYTES), dtype=np.uint8)
    scale = np.full((rows, cols // Q4_0_VALUES), 1 / (4.6 * np.sqrt(cols)), dtype=np.float16)
    blocks[..., :2] = scale.view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def write_gguf(name: str, shape: Shape, path: Path) -> float:
    """Write the random GGUF tensor by tensor (never the whole model in memory); seconds."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    start = time.perf_counter()
    source = GGUFReader(str(default_gguf()))
    head_dim = shape.hidden // shape.heads
    w = GGUFWriter(str(path), "llama")
    w.add_name(f"random-{name}")
    w.add_block_count(shape.layers)
    w.add_context_length(8192)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_file_type(2)  # MOSTLY_Q4_0
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            types = field.types
            w.add_key_value(key, field.contents(), types[0], types[1] if len(types) > 1 else None)
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    w.add_vocab_size(vocab)
    q, f32 = GGMLQuantizationType.Q4_0, np.dtype(np.float32)
    tensors: list[tuple[str, int, int]] = [("token_embd.weight", vocab, shape.hidden)]
    norms = ["output_norm.weight"]
    if not shape.tied:
        tensors.append(("output.weight", vocab, shape.hidden))
    kv = shape.kv_heads * head_dim
    for i in range(shape.layers):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_q.weight", shape.hidden, shape.hidden),
            (b + "attn_k.weight", kv, shape.hidden),
            (b + "attn_v.weight", kv, shape.hidden),
            (b + "attn_output.weight", shape.hidden, shape.hidden),
            (b + "ffn_gate.weight", shape.ffn, shape.hidden),
            (b + "ffn_up.weight", shape.ffn, shape.hidden),
            (b + "ffn_down.weight", shape.hidden, shape.ffn),
        ]
        norms += [b + "attn_norm.weight", b + "ffn_norm.weight"]
    for tname, rows, cols in tensors:
        nbytes = rows * cols // Q4_0_VALUES * Q4_0_BYTES
        row_bytes = cols // Q4_0_VALUES * Q4_0_BYTES  # gguf-py takes a raw tensor's byte shape
        w.add_tensor_info(tname, [rows, row_bytes], np.dtype(np.uint8), nbytes, raw_dtype=q)
    for tname in norms:
        w.add_tensor_info(tname, [shape.hidden], f32, shape.hidden * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _, rows, cols in tensors:
        w.write_tensor_data(_q4_0(rows, cols, rng))
    for _ in norms:
        w.write_tensor_data(np.ones(shape.hidden, dtype=np.float32))
    w.close()
    return time.perf_counter() - start


def model_file(name: str) -> tuple[Path, float | None]:
    if name == "135m":
        return default_gguf(), None
    path = models_dir() / f"random-{name}-q4_0.gguf"
    if path.is_file():
        return path, None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    seconds = write_gguf(name, SHAPES[name], tmp)
    tmp.replace(path)
    return path, seconds


def chatstore_server(model: Path, log_dir: Path) -> ServerProcess:
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="chatstore-bench-sizes-"))
    argv = [sys.executable, "-m", "chatstore", "serve", "--port", str(port)]
    argv += ["--data-dir", str(data), "--model", str(model), "--kv-store", "off"]
    argv += ["--kv-cache-bytes", str(KV_POOL_BYTES)]
    env = {**os.environ, "CHATSTORE_API_KEYS": "", "CHATSTORE_ADMIN_KEY": ""}
    env.pop("CHATSTORE_DTYPE", None)
    return ServerProcess("chatstore", argv, env, port, "/readyz", log_dir / "chatstore.log", 1800)


def llamacpp_server(model: Path, log_dir: Path, threads: int) -> ServerProcess:
    port = free_port()
    home = os.environ.get("PEERS_HOME", str(Path.home() / ".cache" / "chatstore-peers"))
    env = {**os.environ, "PEERS_HOME": home, "MODEL": str(model), "THREADS": str(threads)}
    env["VERBOSE"] = "False"
    argv = ["bash", str(PEERS / "serve.sh"), "default", str(port)]
    return ServerProcess("llama.cpp", argv, env, port, "/v1/models", log_dir / "llama.log", 1800)


def measure(server: ServerProcess, maker: PromptMaker, reps: int, tokens: int) -> dict:
    start = time.perf_counter()
    with server, httpx.Client(trust_env=False, timeout=3600) as http:
        url = server.url
        hello = [{"role": "user", "content": "Hi"}]
        timed_stream(http, url, hello, 1)  # one token: the reply ends with it
        load_s = time.perf_counter() - start
        prompts = [maker.fresh_prompt(f"sizes-{i}", 2000) for i in range(reps)]
        timed_stream(http, url, maker.fresh_prompt("warm-up", 256), 4)
        fills = [timed_stream(http, url, p, 1) for p in prompts]
        decodes = [timed_stream(http, url, decode_prompts(1, r)[0], tokens) for r in range(reps)]
        assert server.proc is not None
        peak = proc_status_mb(server.proc.pid, "VmHWM")
        steady = proc_status_mb(server.proc.pid, "VmRSS")
    counts = [t.prompt_tokens or maker.count(p) for t, p in zip(fills, prompts, strict=True)]
    return {
        "load_s": round(load_s, 2),
        "peak_rss_mb": round(peak),
        "steady_rss_mb": round(steady),
        "prefill_2k": round(
            statistics.median(n / t.ttft for n, t in zip(counts, fills, strict=True)), 2
        ),
        "prefill_tokens": counts[0],
        "decode_b1": round(statistics.median((t.tokens - 1) / t.decode_s for t in decodes), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1b,8b", help="of 135m, 1b, 8b")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--no-llamacpp", action="store_true")
    args = parser.parse_args()
    import torch

    from chatstore.model import load_model

    threads = torch.get_num_threads()
    maker = PromptMaker(load_model(dtype=torch.float32).tokenizer)
    use_llama = not args.no_llamacpp and llamacpp_ready()
    if not use_llama and not args.no_llamacpp:
        print("llama.cpp's venv is not built (../shared/peers/llamacpp/setup.sh)", file=sys.stderr)
    log_dir = Path(tempfile.mkdtemp(prefix="chatstore-bench-sizes-logs-"))
    out: dict[str, object] = {"machine": machine_report(), "threads": threads, "logs": str(log_dir)}
    for name in args.shapes.split(","):
        path, wrote = model_file(name)
        size_mb = path.stat().st_size / 2**20
        written = f", written in {wrote:.0f} s" if wrote else ""
        print(f"{name}: {path} ({size_mb:.0f} MB{written})", flush=True)
        tokens = 32 if name == "8b" else 128
        # an unmeasured start converts and caches the file's tokenizer (once per file)
        with chatstore_server(path, log_dir):
            pass
        ours = measure(chatstore_server(path, log_dir), maker, args.reps, tokens)
        print(f"  chatstore  {ours}", flush=True)
        row: dict[str, object] = {"file_mb": round(size_mb), "write_s": wrote, "chatstore": ours}
        if use_llama:
            theirs = measure(llamacpp_server(path, log_dir, threads), maker, args.reps, tokens)
            print(f"  llama.cpp  {theirs}", flush=True)
            row["llamacpp"] = theirs
            for key in ("decode_b1", "prefill_2k"):
                row[f"{key}_vs_llamacpp"] = ratio(ours[key], theirs[key])
            row["load_vs_llamacpp"] = ratio(ours["load_s"], theirs["load_s"])
        budget = size_mb + KV_POOL_BYTES / 2**20  # the yardstick: the file + KV pool
        row["steady_rss_vs_file_and_kv"] = round(ours["steady_rss_mb"] / budget, 3)
        row["peak_rss_vs_file_and_kv"] = round(ours["peak_rss_mb"] / budget, 3)
        out[name] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main()
