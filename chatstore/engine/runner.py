"""Our own forward pass for the Llama family (Llama, Mistral, Qwen2, Qwen3) over a weight source.

Per layer:

    x = norm(h) -> qkv = x Wqkv (+b) -> pre-RoPE K, V to the KV sink (the store)
      -> q, k rotated at explicit positions; k, v written into the paged pool
      -> attention over the pool -> h += o Wo; x = norm(h) -> gu = x Wgu
      -> silu(gate) * up -> h += . Wdown; x = next layer's norm(h)

Logits only for the rows asked for. The element-wise steps (norm with the residual add, RoPE
with the pool write, SiLU * up) are fused native kernels on a CPU (`chatstore.kernels.fused_ops`,
torch ops elsewhere); projections run on prepacked oneDNN weights where that is faster
(`linear.py`); attention reads the paged pool in place: the decode kernel when every sequence
has one new token, the paged-prefill kernel for everything else (fresh prompts, new turns on
pooled history, mixed batches). Which of those runs is the KV layout's to say (`kv_layout.py`,
chosen once from the cache in `layouts.py`): with the vAttention layout every sequence's KV is
contiguous in its slot and attention is stock SDPA over it (`chatstore.engine.vattention`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.nn.functional as F

from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.host_memory import keep_freed_memory, release_free_memory
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.kv_layout import AttentionKernels
from chatstore.engine.layouts import layout_of
from chatstore.engine.linear import Linear, packing_available
from chatstore.engine.rope import RotaryEmbedding
from chatstore.engine.weight_plan import Projection, ProjectionFactory
from chatstore.kernels.fused_ops import NativeOps, TorchOps
from chatstore.kernels.paged_prefill import native_prefill_supported
from chatstore.model.spec import ModelSpec
from chatstore.model.weights import LayerTensors, ModelWeights, as_weights, release_file_pages

if TYPE_CHECKING:
    from chatstore.kernels.triton.fused_ops import TritonOps

# Called per layer with the pre-RoPE K and the V of the step's new tokens ([T, Hkv, D] each):
# the hook through which the store saves position-decoupled KV.
KVSink = Callable[[int, torch.Tensor, torch.Tensor, ForwardBatch], None]

# auto: the fast paths (native kernels, prepacked weights) where they apply;
# reference: torch ops and gather-and-SDPA attention everywhere, the path tests compare against.
ATTENTION_BACKENDS = ("auto", "reference")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Projection  # [H] -> [(Hq + 2 Hkv) D], fused q/k/v (with Qwen2's bias)
    o_proj: Projection  # [Hq D] -> [H]
    post_norm: torch.Tensor  # [H]
    gate_up: Projection  # [H] -> [2 I], fused gate/up
    down: Projection  # [I] -> [H]
    q_norm: torch.Tensor | None = None  # [D], Qwen3: RMSNorm of each q head before RoPE
    k_norm: torch.Tensor | None = None  # [D], of each k head (the stored K is after it)


class ModelRunner:
    def __init__(
        self,
        weights: ModelWeights | torch.nn.Module,
        spec: ModelSpec,
        kv_cache: PagedKVCache,
        attention: str = "auto",
        projections: ProjectionFactory | None = None,
        triton: bool | None = None,
    ) -> None:
        """`weights`: the model's weight source (`chatstore.model.weights`: a GGUF file, a
        safetensors directory), or a transformers model whose weights are taken as they are.
        The projections are built layer by layer from it, each tensor read when it is needed.
        `projections` builds each projection (`weight_plan.Projections`: int8 / int4
        weights); by default every one is a `Linear` in the model's dtype. `triton` is
        `AttentionKernels.triton`: None takes the Triton kernels (attention and the fused
        element-wise ops) where the model runs on CUDA; True forces them on any device (the
        tests, in Triton's CPU interpreter); False never takes them."""
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
        self.spec = spec
        self.kv_cache = kv_cache
        self.layout = layout_of(kv_cache)
        self.attention = attention
        self.device = kv_cache.device
        source = as_weights(weights)
        # a table the projections read from the file's quantized blocks is not read as floats
        takes_float = getattr(projections, "takes_float", None)
        if takes_float is None or takes_float("embeddings", None):
            self.embed = source.embeddings()
        else:
            self.embed = torch.empty((spec.vocab_size, 0), dtype=source.dtype, device=self.device)
        self.final_norm = source.final_norm()
        self.dtype = self.embed.dtype
        if kv_cache.dtype != self.dtype:
            raise ValueError(
                f"KV cache dtype {kv_cache.dtype} differs from model dtype {self.dtype}"
            )
        fast = attention == "auto"
        pack = fast and packing_available(self.device, self.dtype)
        if projections is None:
            projections = _dense_projections(pack)
        if spec.tie_word_embeddings:
            head = self.embed
        elif takes_float is None or takes_float("lm_head", None):
            head = source.lm_head()
        else:  # an untied head taken quantized from the file (an 8B's: 2 GB of fp32 unread)
            head = torch.empty((spec.vocab_size, 0), dtype=self.dtype, device=self.device)
        self.lm_head = projections("lm_head", None, head, None)
        # where the weights are expanded, the embeddings are read from the file's quantized
        # table too (`weight_plan.Projections.embedding_rows`); else a 16-bit table
        rows_from = getattr(projections, "embedding_rows", None)
        self.embed_rows = rows_from(self.lm_head) if rows_from is not None else None
        if self.embed_rows is not None:
            # the 16-bit table goes (an empty tensor of its dtype and width stays readable)
            self.embed = self.embed.new_empty((0, self.embed.shape[1]))
        # roles the projections take quantized from the file need no float weights read
        self.layers = []
        for i in range(spec.num_layers):
            unread = frozenset(r for r in ROLES if takes_float and not takes_float(r, i))
            self.layers.append(self._layer_weights(source.layer(i, unread), i, projections))
            # layer by layer: else the whole file is resident beside the weights at the end
            release_file_pages(source, getattr(projections, "gguf", None))
        self.rope = RotaryEmbedding(source.rope, spec.head_dim, self.device)
        self.scale = spec.head_dim**-0.5
        self._native_prefill = fast and native_prefill_supported(
            self.dtype, self.device, spec.head_dim
        )
        self.kernels = AttentionKernels(
            fast, self._native_prefill, self.scale, spec.num_heads // spec.num_kv_heads, triton
        )
        self.ops = elementwise_ops(self.kernels, self.device, self.dtype, spec.head_dim)
        if self.device.type == "cpu":
            release_free_memory()  # the file's tensors, read layer by layer and dropped
            # only now: during the build glibc's default thresholds hand each large transient
            # (a tensor read or repacked) back on free; kept in the heap they fragmented it,
            # an 8B load peaking at 2x its steady RSS
            keep_freed_memory()

    @staticmethod
    def _layer_weights(t: LayerTensors, index: int, make: ProjectionFactory) -> LayerWeights:
        bias = None if t.qkv_bias is None else torch.cat(t.qkv_bias)
        return LayerWeights(
            input_norm=t.input_norm,
            qkv=make("qkv", index, stacked_rows(t.q, t.k, t.v), bias),
            o_proj=make("o_proj", index, t.o, None),
            post_norm=t.post_norm,
            gate_up=make("gate_up", index, stacked_rows(t.gate, t.up), None),
            down=make("down", index, t.down, None),
            q_norm=t.q_norm,
            k_norm=t.k_norm,
        )

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_sink: KVSink | None = None,
        layer_ready: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits [len(batch.logits_indices), V] in fp32.

        `layer_ready(i)`, when given, is called right before layer i's attention reads the pool
        (after the step's own K, V are written): a layer-wise KV pre-load blocks there until
        layer i's history is in place (StoreConnector.wait_for_layer)."""
        spec, ops, eps = self.spec, self.ops, self.spec.rms_norm_eps
        hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if self.embed_rows is not None:
            h = self.embed_rows(batch.input_ids)  # [T, H], the residual stream
        else:
            h = F.embedding(batch.input_ids, self.embed)
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)
        cos, sin = cos[:, 0], sin[:, 0]  # [T, D]
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        attention = self.layout.step_attention(batch, self.kernels)
        for i, w in enumerate(self.layers):
            qkv = w.qkv(x)  # [T, (Hq + 2 Hkv) D]
            if w.q_norm is not None and w.k_norm is not None:
                _norm_heads(ops, qkv, w.q_norm, w.k_norm, hq, hkv, eps)
            if kv_sink is not None:
                k_pre = qkv[:, hq * d : (hq + hkv) * d].view(-1, hkv, d)
                kv_sink(i, k_pre, qkv[:, (hq + hkv) * d :].view(-1, hkv, d), batch)
            q, k, v = ops.rope_store_kv(
                qkv,
                cos,
                sin,
                batch.slot_mapping,
                self.kv_cache.k(i),
                self.kv_cache.v(i),
                hq,
                hkv,
                # Attention that reads the pool in place needs no copy of the step's k, v.
                want_kv=not attention.in_place,
            )
            if layer_ready is not None:
                layer_ready(i)
            attn = attention(i, q, k, v)  # [T, Hq, D]
            x = ops.add_rms_norm(h, w.o_proj(attn.reshape(-1, hq * d)), w.post_norm, eps)
            act = ops.silu_mul(w.gate_up(x))
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            if next_norm is None:
                h.add_(w.down(act))
            else:
                x = ops.add_rms_norm(h, w.down(act), next_norm, eps)
        h = ops.rms_norm(h.index_select(0, batch.logits_indices), self.final_norm, eps)
        return self.lm_head(h).float()

    @property
    def mixed_batches_in_place(self) -> bool:
        """Whether a batch mixing decodes and prefill chunks attends as fast as either alone:
        the CPU's native prefill kernel, or Triton's unified kernel (one launch for both)."""
        return self._native_prefill or self.triton_attention

    @property
    def triton_attention(self) -> bool:
        """Whether the paged layout's attention is Triton's unified kernel (CUDA)."""
        return self.layout.name == "paged" and self.kernels.use_triton(self.device)


ROLES = ("qkv", "o_proj", "gate_up", "down")  # a layer's projections


def stacked_rows(*parts: torch.Tensor) -> torch.Tensor:
    """The parts' rows as one matrix: where they already lie one after another in one buffer
    (a GGUF source reads a layer's q, k, v so), that buffer itself; else `torch.cat`."""
    first = parts[0]
    at = first.storage_offset()
    for p in parts:
        same = p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (same and p.is_contiguous() and p.storage_offset() == at):
            return torch.cat(parts)
        at += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _norm_heads(
    ops: ElementwiseOps,
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    hq: int,
    hkv: int,
    eps: float,
) -> None:
    """Qwen3's q/k norm, in place in qkv: each q head and each k head RMS-normalised over its
    D values with its own weight, before RoPE and before K is handed to the store (stored K is
    normalised, un-rotated: a restore applies RoPE only, as for every other model)."""
    d = q_norm.shape[0]
    rows = qkv.shape[0]
    q = qkv[:, : hq * d].reshape(rows * hq, d)  # qkv's rows are strided: a copy
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(rows * hkv, d)
    qkv[:, : hq * d] = ops.rms_norm(q, q_norm, eps).view(rows, hq * d)
    qkv[:, hq * d : (hq + hkv) * d] = ops.rms_norm(k, k_norm, eps).view(rows, hkv * d)


# The fused element-wise ops a runner can take: the CPU's C kernels, Triton's, or torch ops.
ElementwiseOps: TypeAlias = "NativeOps | type[TorchOps] | type[TritonOps]"


def elementwise_ops(
    kernels: AttentionKernels, device: torch.device, dtype: torch.dtype, head_dim: int
) -> ElementwiseOps:
    """TritonOps where the Triton kernels serve (CUDA; imported only then), the native C ops on
    a CPU where they apply, torch ops otherwise (the reference path, float16 on a CPU)."""
    if kernels.use_triton(device):
        from chatstore.kernels.triton.fused_ops import TritonOps

        return TritonOps
    if kernels.fast and NativeOps.applies(dtype, device, head_dim):
        return NativeOps()
    return TorchOps


def _dense_projections(pack: bool) -> ProjectionFactory:
    return lambda role, layer, weight, bias: Linear(weight, bias, pack)
