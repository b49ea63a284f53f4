"""Weight-only quantized projections (issue 25): each kernel against a float matmul of its
dequantised weight, the GGUF repacking against gguf's own dequantize, runners with int8 / int4
weights against runners on the dequantised weights, and a server started with weights = int4."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from chatstore.config import load_config
from chatstore.engine.block_pool import BlockPool
from chatstore.engine.generate import GenerateOptions, generate
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.linear import Linear
from chatstore.engine.quant_linear import NEVER, Int4Linear, Int8Linear
from chatstore.engine.runner import ModelRunner
from chatstore.engine.weight_plan import (
    DENSE_FROM,
    Projections,
    prefill_copy_bytes,
    prefill_mode,
    resolve_format,
)
from chatstore.model.gguf_repack import repack
from chatstore.model.gguf_weights import GGUFWeights
from chatstore.model.quant_weights import (
    Int4Weight,
    Int8Weight,
    cat_rows,
    quantize_int4,
    quantize_int8,
)
from chatstore.model.weights import as_weights
from tests.engine.test_runner_exact import full_logits
from tests.support.reference import default_hf_model
from tests.support.tiny_models import TINY_ARCHS, tiny_hf_model

ALWAYS_QUANT = dict.fromkeys(DENSE_FROM, NEVER)  # the quantized kernel at every token count
# These tests hold torch's int4 kernel (bf16 activations) to its references on every CPU; the
# native integer-dot kernel, what auto picks without AVX512-BF16, has its own tests
# (tests/kernels/test_int4_matmul.py).


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: these shapes gain nothing from two, and a busy machine makes two slow."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def embedded_gguf(default_model) -> GGUFWeights:
    return GGUFWeights(default_model.gguf, default_model.spec)


def rounded(w: Int4Weight | Int8Weight) -> torch.Tensor:
    """The dequantised weight with its scales (and zeros) in bf16, as the kernels read them."""
    bf16 = torch.bfloat16
    if isinstance(w, Int8Weight):
        return w._replace(scale=w.scale.to(bf16).float()).dequantize()
    return w._replace(scale=w.scale.to(bf16).float(), zero=w.zero.to(bf16).float()).dequantize()


class DequantisedMatmul:
    """The float reference of a quantized projection: its dequantised weight in a plain matmul,
    at the kernels' edges (input rounded to bf16, fp32 sums, output rounded to bf16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight_t, self.bias = weight.float().t(), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bf16 = torch.bfloat16
        y = (x.to(bf16).float() @ self.weight_t).to(bf16).to(x.dtype)
        return y if self.bias is None else y + self.bias


def assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within the output's bf16 rounding (2^-8 relative) and a differing summation order."""
    assert got.dtype == ref.dtype
    assert (got.float() - ref.float()).abs().max().item() <= 1e-2 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_int8_linear_is_a_matmul_of_its_dequantised_weight(dtype, tokens) -> None:
    torch.manual_seed(0)
    w, bias = torch.randn(96, 128) * 0.05, torch.randn(96)
    q = quantize_int8(w)
    inside = w.abs() <= 127 * q.scale[:, None]  # the rest is clipped to +-127 steps
    error = (q.dequantize() - w).abs()
    assert (error[inside] <= (q.scale[:, None] / 2 + 1e-7).expand_as(w)[inside]).all()
    assert torch.equal(q.scale, q.scale.to(torch.bfloat16).float())  # as the kernel reads it
    x, b = torch.randn(tokens, 128).to(dtype), bias.to(dtype)
    assert_matches(Int8Linear(q, b)(x), DequantisedMatmul(rounded(q), b)(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_int4_linear_is_a_matmul_of_its_dequantised_weight(dtype, group, tokens) -> None:
    torch.manual_seed(1)
    w = torch.randn(80, 256) * 0.05
    q = quantize_int4(w, group)
    step = q.scale.repeat_interleave(group, dim=1)
    zero = q.zero.repeat_interleave(group, dim=1)
    # round to nearest, off by at most the bf16 rounding of the zero at a group's ends
    assert ((q.dequantize() - w).abs() <= step / 2 + zero.abs() / 256 + 1e-6).all()
    x = torch.randn(tokens, 256).to(dtype)
    assert_matches(Int4Linear(q, None)(x), DequantisedMatmul(rounded(q), None)(x))


def test_dense_copy_takes_the_token_counts_from_dense_from() -> None:
    torch.manual_seed(2)
    w = torch.randn(64, 64)
    dense = Linear(w, None, pack=False)
    lin = Int4Linear(quantize_int4(w, 32), None, dense, dense_from=8)
    x = torch.randn(8, 64)
    assert torch.equal(lin(x), dense(x))  # 8 tokens: the 16/32-bit weight itself
    assert not torch.equal(lin(x[:7]), dense(x[:7]))  # 7: the 4-bit one


def random_q4_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_K blocks with random codes and 6-bit scales, and finite f16 d / dmin."""
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        field = (rng.random((n, k // 256)) * 0.01 + 1e-4).astype(np.float16)
        blocks[..., at : at + 2] = field.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_gguf_repack_computes_with_gguf_dequantize(type_name) -> None:
    rng = np.random.default_rng(3)
    n, k = 48, 512
    qtype = GGMLQuantizationType[type_name]
    if type_name == "Q4_K":  # gguf quantizes no K-quant: its layout, from random blocks
        data = random_q4_k(n, k, rng)
    else:
        data = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    reference = torch.from_numpy(dequantize(data, qtype))
    weight = repack(type_name, data, n, k)
    torch.testing.assert_close(weight.dequantize(), reference, rtol=0, atol=1e-6)
    x = torch.randn(3, k)
    assert_matches(Int4Linear(weight, None)(x), DequantisedMatmul(reference, None)(x))


def test_embedded_gguf_repacks_into_the_loaded_layout(default_model, embedded_gguf) -> None:
    """Fused q/k/v rows in transformers' order (llama.cpp permuted q and k) and the Q8_0
    lm_head: the GGUF's codes give back the weights transformers dequantised."""
    gguf = embedded_gguf
    hf = default_hf_model()
    attn = hf.model.layers[4].self_attn
    parts = gguf.parts("qkv", 4)
    assert [p.type_name for p in parts] == ["Q4_1"] * 3
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
    fused = cat_rows([p.weight for p in parts])  # type: ignore[misc]
    torch.testing.assert_close(fused.dequantize(), qkv, rtol=0, atol=1e-6)
    (head,) = gguf.parts("lm_head", None)
    assert head.type_name == "Q8_0" and head.weight.input_repeat == 2  # type: ignore[union-attr]
    torch.testing.assert_close(
        head.weight.dequantize(),  # type: ignore[union-attr]
        hf.lm_head.weight.detach(),
        rtol=0,
        atol=1e-6,
    )


def dequantised_projections(fmt: str):
    """A reference runner's projections: plain float matmuls of the weights `fmt` computes
    with (the quantizer's output, dequantised with bf16 scales)."""
    quantizer = quantize_int8 if fmt == "int8" else (lambda w: quantize_int4(w, 32))
    return lambda role, layer, weight, bias: DequantisedMatmul(rounded(quantizer(weight)), bias)


def runner_with(weights, projections) -> tuple[ModelRunner, BlockPool]:
    """A runner over `weights` (a transformers model or a weight source) in fp32."""
    spec = as_weights(weights).spec
    kv = PagedKVCache(spec, 64, 16, dtype=torch.float32)
    return ModelRunner(weights, spec, kv, "auto", projections), BlockPool(64)


def greedy(runner, pool, ids: list[int], n: int) -> list[int]:
    options = GenerateOptions(max_new_tokens=n, temperature=0.0)
    return list(generate(runner, pool, ids, options))


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_runner_matches_the_dequantised_weights_runner(arch, fmt) -> None:
    hf = tiny_hf_model(arch)
    ours = runner_with(
        hf, Projections(fmt, torch.float32, True, dense_from=ALWAYS_QUANT, int4="torch")
    )
    ref = runner_with(hf, dequantised_projections(fmt))
    ids = torch.randint(2, 256, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    logits, expected = full_logits(*ours, ids), full_logits(*ref, ids)
    # both round every projection's input and output to bf16: a flipped last bit somewhere
    # is all that may differ (measured 2.4e-4 on logits up to ~0.5)
    assert (logits - expected).abs().max().item() <= 1e-2 * expected.abs().max().item()
    assert greedy(*ours, ids, 12) == greedy(*ref, ids, 12)


def test_prefill_computes_on_the_expanded_quantized_weight_and_decode_on_the_kernel(
    monkeypatch,
) -> None:
    """From DENSE_FROM tokens on, a projection multiplies its quantized weight expanded into the
    shared scratch (issue 35 item 2: no 16-bit copy of the float weight stays): a prompt's logits
    are a runner's of plain fp32 matmuls over the dequantised weights, not the float model's;
    the tied head runs on the embedding table itself; one token runs the int4 kernel. (The
    integer-dot-product prefill of AVX512-VNNI CPUs, off here: tests/model/test_int8_prefill.py.)"""
    monkeypatch.setenv("CHATSTORE_INT8_PREFILL", "0")
    hf = tiny_hf_model("llama", seed=5, tie_word_embeddings=True)
    quant = Projections("int4", torch.float32, True, int4="torch", tied_head=True)
    hybrid = runner_with(hf, quant)

    def expanded(role, layer, weight, bias):
        if role == "lm_head":
            return Linear(weight, bias, pack=False)
        return Linear(rounded(quantize_int4(weight, 32)), bias, pack=False)

    ids = torch.randint(2, 256, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    got, want = full_logits(*hybrid, ids), full_logits(*runner_with(hf, expanded), ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # 40 >= DENSE_FROM
    float_model = full_logits(*runner_with(hf, None), ids)
    assert (got - float_model).abs().max() > 100 * (got - want).abs().max()
    runner = hybrid[0]
    for layer in runner.layers:
        for proj in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            assert proj.dense is None and proj.scratch is quant.scratch
    assert runner.lm_head.dense.weight_t.data_ptr() == runner.embed.data_ptr()
    widest = max(p.shape[0] * p.shape[1] for p in (runner.layers[0].gate_up, runner.layers[0].down))
    assert quant.scratch.nbytes == 4 * widest  # one buffer, the largest weight's
    quant_only = runner_with(
        hf, Projections("int4", torch.float32, True, dense_from=ALWAYS_QUANT, int4="torch")
    )
    one = ids[:1]  # a single token runs the 4-bit kernels in both
    assert torch.equal(full_logits(*hybrid, one), full_logits(*quant_only, one))


def test_embedded_model_int4_from_gguf_agrees_with_its_dequantised_weights(
    default_model, embedded_gguf
):
    """The GGUF's own codes (Q4_1 layers, Q8_0 lm_head) in the int4 kernel against the fp32
    runner over the same GGUF dequantised (its tensors read directly, `gguf_source.py`). Both
    kernels round a projection's input and output to bf16, so the bound is the noise of exactly
    that rounding:
    float matmuls of the same weights at the same bf16 edges (`DequantisedMatmul`) land this
    far from fp32 (measured 0.48 on logits up to ~30; the int4 runner 0.73: the kernel also
    rounds its dequantised weight to bf16). A short prompt, as fp32 compute runs the 4-bit path
    at every token count here."""
    quant = Projections(
        "gguf", torch.float32, True, embedded_gguf, dense_from=ALWAYS_QUANT, int4="torch"
    )
    ours = runner_with(default_model.weights, quant)
    expected_kinds = {f"{role}: int4 from GGUF Q4_1" for role in ("qkv", "o_proj", "gate_up")}
    expected_kinds |= {"down: int4 from GGUF Q4_1", "lm_head: int4 from GGUF Q8_0"}
    expected_kinds.add("embeddings: rows of the GGUF's quantized table")  # expanding: no table
    assert set(quant.built) == expected_kinds
    edges = runner_with(default_model.weights, lambda r, i, w, b: DequantisedMatmul(w, b))
    dense = runner_with(default_model.weights, None)
    ids = default_model.tokenizer.encode("The capital of France is")
    expected = full_logits(*dense, ids)
    bf16_noise = (full_logits(*edges, ids) - expected).abs().max().item()
    assert (full_logits(*ours, ids) - expected).abs().max().item() <= 3 * bf16_noise
    assert greedy(*ours, ids, 10) == greedy(*dense, ids, 10)  # measured: all 10 agree


def test_expanded_gguf_reads_its_embeddings_from_the_quantized_table(default_model, embedded_gguf):
    """prefill = expand on the model as published: the embeddings are rows of the tied head's
    Q8_0 pack (no 16-bit table stays), the file's table up to its f16 scales read as bf16 (the
    int4 kernels' scales); the head stays quantized at every row count; the logits stay within
    the bf16 noise of the dense runner, the greedy tokens equal."""
    quant = Projections(
        "gguf", torch.float32, True, embedded_gguf, int4="torch", tied_head=True, prefill="expand"
    )
    runner, pool = runner_with(default_model.weights, quant)
    assert runner.embed_rows is not None and runner.embed.numel() == 0
    assert runner.lm_head.dense is None and "embeddings: rows of the GGUF" in quant.describe()
    # the layers' float weights were never read: the file's blocks are all the build took
    assert not any(quant.takes_float(role, 0) for role in ("qkv", "o_proj", "gate_up", "down"))
    dense = runner_with(default_model.weights, None)
    ids = default_model.tokenizer.encode("The capital of France is")
    rows = runner.embed_rows(torch.tensor(ids))
    torch.testing.assert_close(rows, dense[0].embed[ids], rtol=2**-8, atol=1e-6)
    expected = full_logits(*dense, ids)
    edges = runner_with(default_model.weights, lambda r, i, w, b: DequantisedMatmul(w, b))
    bf16_noise = (full_logits(*edges, ids) - expected).abs().max().item()
    assert (full_logits(runner, pool, ids) - expected).abs().max().item() <= 3 * bf16_noise
    assert greedy(runner, pool, ids, 10) == greedy(*dense, ids, 10)


def test_native_kernel_reads_the_tied_heads_rows_too(default_model, embedded_gguf):
    """On the native int4 kernel (CPUs without AVX512-BF16) the embeddings are rows of the tied
    Q8_0 head's native pack: the file's table (fp32 scales: within fp32 rounding of it)."""
    quant = Projections(
        "gguf", torch.float32, True, embedded_gguf, int4="native", tied_head=True, prefill="expand"
    )
    runner, _ = runner_with(default_model.weights, quant)
    assert runner.embed_rows is not None and runner.embed.numel() == 0
    assert runner.embed_rows.table.kernel == "native"
    ids = torch.tensor(default_model.tokenizer.encode("The capital of France is"))
    table = runner_with(default_model.weights, None)[0].embed
    torch.testing.assert_close(runner.embed_rows(ids), table[ids], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("weights", "dtype", "device", "from_gguf", "given", "expected"),
    [
        ("auto", "auto", "cpu", True, False, "gguf"),  # the embedded model as shipped
        ("auto", "float32", "cpu", True, False, "dense"),  # an explicit dtype: exact path
        ("auto", "auto", "cpu", True, True, "dense"),  # a model handed in is served as loaded
        ("auto", "auto", "cpu", False, False, "dense"),  # a HF directory
        ("auto", "auto", "cuda", True, False, "dense"),
        ("int4", "float32", "cpu", False, False, "int4"),
        ("int8", "auto", "cpu", True, True, "int8"),
        ("bf16", "auto", "cpu", True, False, "dense"),
    ],
)
def test_weights_setting_resolves(weights, dtype, device, from_gguf, given, expected) -> None:
    assert resolve_format(weights, dtype, device, from_gguf, given) == expected


def test_weights_config() -> None:
    assert load_config(overrides={"weights": "bf16"}, env={}).torch_dtype == torch.bfloat16
    assert load_config(env={"CHATSTORE_WEIGHTS": "int4"}).weights == "int4"
    with pytest.raises(ValueError, match="weights = fp32 needs dtype = float32"):
        load_config(overrides={"weights": "fp32", "dtype": "bfloat16"}, env={})
    with pytest.raises(ValueError, match="weights must be one of"):
        load_config(overrides={"weights": "int3"}, env={})
    with pytest.raises(ValueError, match="CPU only"):
        resolve_format("int4", "auto", "cuda", True, False)


def test_server_with_int4_weights_serves_a_turn(tmp_path) -> None:
    from chatstore.server.in_process import start_in_process

    overrides = {"weights": "int4", "data_dir": str(tmp_path), "kv_cache_bytes": 32 << 20}
    overrides["prefill_weights"] = "expand"  # the prompt (> DENSE_FROM tokens) expands
    server = start_in_process(load_config(overrides=overrides))  # fp32: CHATSTORE_DTYPE
    try:
        content = "Hi! Tell me, in a few words, what a compiler does and why it is useful."
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["message"]["content"] and reply.json()["usage"]["completion_tokens"] > 0
        assert reply.json()["usage"]["prompt_tokens"] >= DENSE_FROM["qkv"]
    finally:
        server.stop()


def test_prefill_weights_setting(default_model) -> None:
    """auto copies while the 16-bit copies fit the budget: the embedded model's (212 MB in
    bf16) do, an 8B shape's do not; expand / copy are taken as they are; a bad value is named."""
    spec = default_model.spec
    assert prefill_copy_bytes(spec, torch.bfloat16) == 212_336_640
    assert prefill_mode("auto", spec, torch.bfloat16) == "copy"
    big = dataclasses.replace(
        spec, num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
        num_kv_heads=8, head_dim=128,
    )  # fmt: skip
    assert prefill_mode("auto", big, torch.bfloat16) == "expand"
    assert prefill_mode("copy", big, torch.bfloat16) == "copy"
    assert prefill_mode("expand", spec, torch.bfloat16) == "expand"
    assert load_config(env={"CHATSTORE_PREFILL_WEIGHTS": "expand"}).prefill_weights == "expand"
    with pytest.raises(ValueError, match="prefill_weights must be one of"):
        load_config(overrides={"prefill_weights": "shadow"}, env={})


def test_prefill_on_copies_is_the_float_model_and_keeps_them() -> None:
    """prefill = copy, as before expanding existed: a prompt runs on 16-bit copies of the float
    weights (bit-equal to the dense runner), one token on the int4 kernel."""
    hf = tiny_hf_model("llama", seed=5)
    copies = Projections("int4", torch.float32, True, int4="torch", prefill="copy")
    runner, pool = runner_with(hf, copies)
    assert copies.scratch is None and "prefill on 16-bit copies" in copies.describe()
    assert all(layer.gate_up.dense is not None for layer in runner.layers)
    ids = torch.randint(2, 256, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    dense = runner_with(hf, None)
    assert torch.equal(full_logits(runner, pool, ids), full_logits(*dense, ids))


def test_int8_keeps_a_gguf_q8_0_tensor_as_it_is(default_model, embedded_gguf) -> None:
    """weights = int8 quantizes the Q4_1 layers per channel but serves the Q8_0 head exactly
    (one scale per 32 codes, which per-channel int8 would re-quantize)."""
    make = Projections("int8", torch.float32, False, embedded_gguf)
    head = make("lm_head", None, default_model.weights.lm_head(), None)
    down = make("down", 0, default_model.weights.layer(0).down, None)
    assert isinstance(head, Int4Linear) and isinstance(down, Int8Linear)
    assert set(make.built) == {"lm_head: Q8_0 from GGUF on 2 x int4", "down: int8"}


def test_a_local_gguf_file_loads_with_its_tokenizer_and_template(default_model) -> None:
    """`--model path/to/file.gguf`: its tokenizer converted once (cached under the chatstore
    home), its weights read from the file; the embedded GGUF named by path is the default model
    again."""
    from chatstore.model import load_model
    from chatstore.model.default_model import gguf_path

    loaded = load_model(str(gguf_path()))
    assert loaded.gguf == gguf_path() and loaded.spec == default_model.spec
    assert loaded.tokenizer.chat_template == default_model.tokenizer.chat_template
    ids = loaded.tokenizer.encode("The capital of France is")
    assert ids == default_model.tokenizer.encode("The capital of France is")
    assert torch.equal(loaded.weights.lm_head(), default_model.weights.lm_head())


@pytest.mark.parametrize("int4", ["torch", "native"])
def test_untied_gguf_expanded_reads_token_embd_quantized(tmp_path, int4) -> None:
    """An untied model's own Q4_0 token_embd, packed for either int4 kernel and read by rows:
    the file's table up to its f16 scales read as bf16 (torch's pack; the native one keeps them
    in fp32), and the runner's logits close to the dense runner's over the same file (the
    quantized head and expanded layers compute with those same scales)."""
    from gguf import GGMLQuantizationType as Q

    from chatstore.model.gguf_source import GGUFWeightSource
    from tests.support.gguf_writer import write_gguf

    path = write_gguf(tiny_hf_model("llama", seed=8), tmp_path / "tiny.gguf", Q.Q4_0)
    source = GGUFWeightSource(path)
    gguf = GGUFWeights(path, source.spec)
    quant = Projections("gguf", torch.float32, True, gguf, int4=int4, prefill="expand")
    read_head = source.lm_head  # the head too is taken from the file, its floats never read
    source.lm_head = lambda: pytest.fail("the untied head's float weight was read")  # type: ignore[method-assign]
    runner, pool = runner_with(source, quant)
    source.lm_head = read_head  # type: ignore[method-assign]
    assert runner.embed_rows is not None and runner.embed.numel() == 0
    assert runner.embed_rows.table.kernel == int4
    ids = torch.randint(2, 256, (40,), generator=torch.Generator().manual_seed(9))
    table = source.embeddings()
    torch.testing.assert_close(runner.embed_rows(ids), table[ids], rtol=2**-8, atol=1e-6)
    dense = full_logits(*runner_with(source, None), ids.tolist())
    got = full_logits(runner, pool, ids.tolist())
    assert (got - dense).abs().max().item() <= 2e-2 * dense.abs().max().item()
