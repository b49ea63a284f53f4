"""The runner's weights straight from the file (issue 35 item 1), against transformers.

A GGUF is read tensor by tensor (`gguf_source.py`): the default model's shape, tensors and
logits against transformers' own reading of the file (`from_pretrained(gguf_file=...)`, which
dequantises it into an fp32 model: the path the server used to take), and tiny random models of
every architecture written as GGUFs by gguf-py the same way. A safetensors directory is read
tensor by tensor too (`hf_source.py`), against transformers' forward of the model it saved. And
the server's start builds no transformers model: the module that defines one is never imported.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.generate import GenerateOptions, generate
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.runner import ModelRunner
from chatstore.model import load_model
from chatstore.model.gguf_source import GGUFWeightSource
from chatstore.model.hf_source import SafetensorsWeightSource
from chatstore.model.spec import ModelSpec
from chatstore.model.weights import ModelWeights
from tests.engine.test_runner_exact import full_logits, hf_logits
from tests.support.gguf_writer import write_gguf
from tests.support.reference import default_hf_model
from tests.support.tiny_models import TINY_ARCHS, tiny_hf_model

TOL = 1e-4  # fp32, the reference attention path: our forward against transformers'
# transformers' GGUF reader takes Qwen3's head size from its config default (128): it reads no
# `key_length`, so a tiny Qwen3 GGUF has to have that head size to be read back by it.
GGUF_OVERRIDES = {"qwen3": {"head_dim": 128}}


def runner_over(weights: ModelWeights, attention: str = "reference"):
    kv = PagedKVCache(weights.spec, 64, 16, dtype=torch.float32)
    return ModelRunner(weights, weights.spec, kv, attention), BlockPool(64)


def greedy_ours(weights: ModelWeights, ids: list[int], n: int) -> list[int]:
    runner, pool = runner_over(weights, "auto")
    return list(generate(runner, pool, ids, GenerateOptions(max_new_tokens=n)))


def greedy_hf(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.model
def test_default_gguf_spec_and_tensors_are_transformers_reading_of_the_file(default_model):
    """The shape from the metadata is the config transformers builds from the file; every
    tensor of the first, a middle and the last layer (q/k un-permuted), the embeddings and the
    final norm equal transformers' dequantised ones bit for bit."""
    hf = default_hf_model()
    assert isinstance(default_model.weights, GGUFWeightSource)
    assert default_model.spec == ModelSpec.from_hf_config(hf.config)
    source = default_model.weights
    assert torch.equal(source.embeddings(), hf.model.embed_tokens.weight)
    assert torch.equal(source.lm_head(), hf.lm_head.weight)  # tied: the embeddings
    assert torch.equal(source.final_norm(), hf.model.norm.weight)
    for i in (0, 14, 29):
        ours, theirs = source.layer(i), hf.model.layers[i]
        attn, mlp = theirs.self_attn, theirs.mlp
        pairs = [
            (ours.q, attn.q_proj), (ours.k, attn.k_proj), (ours.v, attn.v_proj),
            (ours.o, attn.o_proj), (ours.gate, mlp.gate_proj), (ours.up, mlp.up_proj),
            (ours.down, mlp.down_proj), (ours.input_norm, theirs.input_layernorm),
            (ours.post_norm, theirs.post_attention_layernorm),
        ]  # fmt: skip
        for got, module in pairs:
            assert torch.equal(got, module.weight), (i, got.shape)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
def test_tiny_gguf_read_directly_matches_transformers_dequantised(tmp_path, arch, qtype):
    """A random model of each architecture written as a GGUF (llama.cpp's layout: Llama and
    Mistral as `llama`, q/k permuted), read by us and by transformers: the same spec, the same
    tensors bit for bit, logits within TOL on a 40-token prompt, the same 12 greedy tokens."""
    from transformers import AutoModelForCausalLM

    model = tiny_hf_model(arch, seed=3, **GGUF_OVERRIDES.get(arch, {}))
    path = write_gguf(model, tmp_path / f"{arch}.gguf", GGMLQuantizationType[qtype])
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ref.eval()
    source = GGUFWeightSource(path)
    assert source.spec == ModelSpec.from_hf_config(ref.config)
    for i, theirs in enumerate(ref.model.layers):  # bit for bit transformers' dequantisation
        ours = source.layer(i)
        for got, module in [(ours.q, theirs.self_attn.q_proj), (ours.k, theirs.self_attn.k_proj),
                            (ours.v, theirs.self_attn.v_proj), (ours.up, theirs.mlp.up_proj),
                            (ours.down, theirs.mlp.down_proj)]:  # fmt: skip
            assert torch.equal(got, module.weight), (i, got.shape)
    ids = random_ids(40, source.spec.vocab_size, seed=7)
    ours = full_logits(*runner_over(source), ids)
    assert (ours - hf_logits(ref, ids)).abs().max().item() <= TOL
    if qtype != "F32":  # the quantization is in force: the file's weights, not the model's
        assert not torch.equal(source.layer(0).down, model.model.layers[0].mlp.down_proj.weight)
    assert greedy_ours(source, ids, 12) == greedy_hf(ref, ids, 12)


@pytest.mark.parametrize(
    ("arch", "tied"), [(a, False) for a in TINY_ARCHS] + [("llama", True), ("qwen2", True)]
)
def test_safetensors_directory_matches_transformers(tmp_path, default_model, arch, tied):
    """`--model dir`: the saved model's tensors read one by one (no transformers model), its
    logits within TOL of transformers' forward of the model that saved them, the same greedy
    tokens; tied embeddings (no lm_head in the file) serve as the head."""
    model = tiny_hf_model(arch, seed=4, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    default_model.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert isinstance(loaded.weights, SafetensorsWeightSource)
    assert loaded.spec == ModelSpec.from_hf_config(model.config)
    ids = random_ids(40, loaded.spec.vocab_size, seed=8)
    ours = full_logits(*runner_over(loaded.weights), ids)
    assert (ours - hf_logits(model, ids)).abs().max().item() <= TOL
    assert greedy_ours(loaded.weights, ids, 12) == greedy_hf(model, ids, 12)


def test_safetensors_directory_loads_in_bf16(tmp_path, default_model):
    """Each tensor converted to the compute dtype as it is read."""
    model = tiny_hf_model("qwen2", seed=4)
    model.save_pretrained(tmp_path)
    default_model.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype=torch.bfloat16)
    layer = loaded.weights.layer(1)
    assert layer.q.dtype == torch.bfloat16 and layer.qkv_bias is not None
    assert torch.equal(layer.q, model.model.layers[1].self_attn.q_proj.weight.bfloat16())


# The server's start in a fresh process: the runtime `chatstore serve` builds (weights = auto),
# one forward, then what transformers modules were imported. PreTrainedModel is defined in
# transformers.modeling_utils; each architecture's classes in transformers.models.<x>.modeling_<x>.
_START = """
import json, sys
import torch
from chatstore.config import Config
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.runtime import create_runtime

runtime = create_runtime(Config(kv_cache_bytes=16 << 20, kv_store="off"))
ids = runtime.model.tokenizer("The capital of France is")["input_ids"]
blocks = runtime.pool.allocate(1)
logits = runtime.runner.forward(ForwardBatch.build([SequenceChunk(ids, 0, blocks)], 16))
modeling = sorted(m for m in sys.modules if m.startswith("transformers") and "modeling" in m)
print(json.dumps({"modeling": modeling, "token": int(torch.argmax(logits[-1]))}))
"""


@pytest.mark.model
def test_loading_the_default_model_builds_no_transformers_model(default_model):
    out = subprocess.run(
        [sys.executable, "-c", _START],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    models = [m for m in result["modeling"] if m.startswith("transformers.models.")]
    # the auto classes' name tables (the tokenizer's lookup) are not a model
    assert models in ([], ["transformers.models.auto.modeling_auto"]), models
    assert "transformers.modeling_utils" not in result["modeling"]
    ids = default_model.tokenizer("The capital of France is")["input_ids"]
    assert result["token"] == int(hf_logits(default_hf_model(), ids)[-1].argmax())


def test_a_bin_checkpoint_directory_loads_tensor_by_tensor(tmp_path, default_model):
    """An older save (pytorch_model.bin, no safetensors) is memory-mapped by torch.load and read
    the same way: logits within TOL of transformers' forward."""
    model = tiny_hf_model("llama", seed=6)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    default_model.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert isinstance(loaded.weights, SafetensorsWeightSource)
    ids = random_ids(30, loaded.spec.vocab_size, seed=9)
    ours = full_logits(*runner_over(loaded.weights), ids)
    assert (ours - hf_logits(model, ids)).abs().max().item() <= TOL


def _mapped_rss_kb(path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's smaps")
def test_a_gguf_source_gives_its_read_pages_back(default_model) -> None:
    """Every page a build reads stays resident in the process's map until released: a GGUF's
    whole size beside the weights built from it. release_pages drops them (the file stays
    readable: a tensor read again reads the same bytes)."""
    others = _mapped_rss_kb(default_model.gguf)  # other maps of the file in this process
    source = GGUFWeightSource(default_model.gguf)
    before = source.tensor("blk.3.ffn_down.weight")
    for index in range(source.spec.num_layers):
        source.layer(index)
    assert _mapped_rss_kb(default_model.gguf) - others > 50_000  # the layers' blocks, read
    source.release_pages()
    assert _mapped_rss_kb(default_model.gguf) - others < 1_000
    assert torch.equal(source.tensor("blk.3.ffn_down.weight"), before)
