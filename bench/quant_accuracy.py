"""What quantized weights cost in accuracy (issue 25, item 5), with the embedded model.

    formats   fp32 and bf16 (dense, transformers' dequantisation of the GGUF), int8 (per-channel
              W8A16 of those weights, bf16 compute) and int4_gguf (the GGUF's own Q4_1 codes and
              its Q8_0 head, bf16 compute: `weights = auto` on this CPU)
    ppl       perplexity of each text's first --tokens tokens in one prefill, every projection
              on its quantized kernel (the 16-bit prefill copy off: the weights' own quality);
              texts: the truncation test's (tests/data/declaration_and_lincoln.txt) and CPython's
              LICENSE.txt (English prose every install ships), pooled over both
    ppl_int8_pct       int8 vs bf16, in percent (bar: <= 1)
    ppl_int4_gguf_pct  int4_gguf vs bf16 (the bf16-dequantised GGUF: they should agree closely)
    int8_prefill       int4_gguf with `prefill_weights = expand` where the CPU has AVX512-VNNI:
              prompts of 12 tokens and more multiply activations quantized per block of 32 to
              int8 against the 4-bit codes (kernels/int4_vnni.py), as llama.cpp computes;
              ppl_int8_prefill_pct against bf16 (absent where the CPU has no VNNI)
    greedy    64 greedy tokens on the four prompts of tests/engine/test_runner_exact.py, as served
              (prompt on the 16-bit copy, decode on the quantized weights): tokens before the
              first difference from bf16's, and positions equal, summed over the prompts

    python bench/quant_accuracy.py [--quick]

`measure_weights_accuracy(quick)` returns the dict (bench/quant.py reads it); printed as JSON,
last. --quick: 64-token texts and 8 greedy tokens, a smoke run (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from chatstore.engine.block_pool import BlockPool  # noqa: E402
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk  # noqa: E402
from chatstore.engine.generate import GenerateOptions, generate  # noqa: E402
from chatstore.engine.kv_cache import PagedKVCache  # noqa: E402
from chatstore.engine.linear import packing_available  # noqa: E402
from chatstore.engine.quant_linear import NEVER  # noqa: E402
from chatstore.engine.runner import ModelRunner  # noqa: E402
from chatstore.engine.weight_plan import DENSE_FROM, Projections, prefill_mode  # noqa: E402
from chatstore.kernels.int4_vnni import int8_prefill_available  # noqa: E402
from chatstore.model import LoadedModel, load_model  # noqa: E402
from chatstore.model.gguf_weights import GGUFWeights  # noqa: E402

TEXTS = {
    "declaration_and_lincoln": ROOT / "tests" / "data" / "declaration_and_lincoln.txt",
    "cpython_license": Path(os.__file__).parent / "LICENSE.txt",
}
PROMPTS = (  # tests/engine/test_runner_exact.py's, whose answers run past 64 tokens
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works, step by step.",
    "Describe the rules of chess for a beginner.",
    "Write a Python function that checks whether a number is prime, and explain it.",
)
ALWAYS_QUANT = dict.fromkeys(DENSE_FROM, NEVER)


def make_runner(
    model: LoadedModel, fmt: str, served: bool, tokens: int, prefill: str = "auto"
) -> ModelRunner:
    kv = PagedKVCache(model.spec, tokens // 16 + 8, 16, model.dtype, "cpu")
    projections = None
    if fmt != "dense":
        gguf = GGUFWeights(model.gguf, model.spec)
        pack = packing_available(torch.device("cpu"), model.dtype)
        projections = Projections(
            fmt,
            model.dtype,
            pack,
            gguf,
            None if served or prefill == "expand" else ALWAYS_QUANT,
            tied_head=model.spec.tie_word_embeddings,
            prefill=prefill_mode(prefill, model.spec, model.dtype),
        )  # as served: the prefill weights auto picks
    return ModelRunner(model.weights, model.spec, kv, "auto", projections)


def nll(runner: ModelRunner, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1:] given what precedes, and its token count."""
    blocks = list(range((len(ids) + 15) // 16))
    batch = ForwardBatch.build([SequenceChunk(ids, 0, blocks)], 16, all_logits=True)
    with torch.no_grad():
        logits = runner.forward(batch)[:-1]
    target = torch.tensor(ids[1:])
    return torch.nn.functional.cross_entropy(logits, target, reduction="sum").item(), len(target)


def greedy(runner: ModelRunner, ids: list[int], n: int) -> list[int]:
    pool = BlockPool(runner.kv_cache.num_blocks)
    return list(generate(runner, pool, ids, GenerateOptions(max_new_tokens=n, temperature=0.0)))


def agreement(ours: list[int], ref: list[int]) -> tuple[int, int]:
    """Tokens before the first difference, and positions equal."""
    prefix = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
    same = sum(a == b for a, b in zip(ours, ref, strict=False))
    return (min(len(ours), len(ref)) if prefix is None else prefix), same


def measure_weights_accuracy(quick: bool = False) -> dict:
    tokens, new = (64, 8) if quick else (1024, 64)
    models = {
        "float32": load_model(dtype=torch.float32),
        "bfloat16": load_model(dtype=torch.bfloat16),
    }
    bf16 = models["bfloat16"]
    cases = {"fp32": ("float32", "dense"), "bf16": ("bfloat16", "dense")}
    cases |= {"int8": ("bfloat16", "int8"), "int4_gguf": ("bfloat16", "gguf")}
    if int8_prefill_available():
        cases["int8_prefill"] = ("bfloat16", "gguf")
    texts = {
        name: bf16.tokenizer.encode(p.read_text())[:tokens]
        for name, p in TEXTS.items()
        if p.is_file()
    }
    prompts = [chat(bf16, p) for p in PROMPTS]
    out: dict = {"ppl_tokens_per_text": tokens, "texts": list(texts), "greedy_tokens": new}
    replies: dict[str, list[list[int]]] = {}
    for case, (dtype, fmt) in cases.items():
        model = models[dtype]
        prefill = "expand" if case == "int8_prefill" else "auto"
        runner = make_runner(model, fmt, served=False, tokens=tokens, prefill=prefill)
        total, count = 0.0, 0
        for name, ids in texts.items():
            s, c = nll(runner, ids)
            out[f"ppl_{case}_{name}"] = round(math.exp(s / c), 4)
            total, count = total + s, count + c
        out[f"ppl_{case}"] = round(math.exp(total / count), 4)
        longest = max(len(p) for p in prompts) + new
        served = make_runner(model, fmt, served=True, tokens=longest, prefill=prefill)
        replies[case] = [greedy(served, p, new) for p in prompts]
        print(f"{case}: ppl {out[f'ppl_{case}']}", file=sys.stderr, flush=True)
    for case in [c for c in ("fp32", "int8", "int4_gguf", "int8_prefill") if c in replies]:
        pairs = [agreement(a, b) for a, b in zip(replies[case], replies["bf16"], strict=True)]
        out[f"greedy_prefix_{case}_vs_bf16"] = [p for p, _ in pairs]
        out[f"greedy_same_{case}_vs_bf16"] = sum(s for _, s in pairs)
    out["greedy_positions"] = new * len(PROMPTS)
    out["ppl_int8_pct"] = round(100 * (out["ppl_int8"] / out["ppl_bf16"] - 1), 3)
    out["ppl_int4_gguf_pct"] = round(100 * (out["ppl_int4_gguf"] / out["ppl_bf16"] - 1), 3)
    if "ppl_int8_prefill" in out:
        ratio = out["ppl_int8_prefill"] / out["ppl_bf16"]
        out["ppl_int8_prefill_pct"] = round(100 * (ratio - 1), 3)
    return out


def chat(model: LoadedModel, prompt: str) -> list[int]:
    rendered = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    return list(rendered["input_ids"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: a smoke run only")
    args = parser.parse_args()
    print(json.dumps(measure_weights_accuracy(args.quick)))


if __name__ == "__main__":
    main()
