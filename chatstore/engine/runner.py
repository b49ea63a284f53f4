"""Our own forward pass for the Llama family (Llama, Mistral, Qwen2) over the HF weights.

Per layer: RMSNorm -> fused q/k/v -> (pre-RoPE K, V handed to the KV sink) -> RoPE at explicit
positions -> K, V written into the paged pool -> attention over the pool -> o_proj -> residual ->
RMSNorm -> fused gate/up -> SiLU -> down -> residual. Logits only for the rows asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.rope import RotaryEmbedding, apply_rope
from chatstore.kernels.paged_attention import attend, paged_attention_reference
from chatstore.kernels.paged_decode import paged_decode
from chatstore.model.spec import ModelSpec

# Called per layer with the pre-RoPE K and the V of the step's new tokens ([T, Hkv, D] each):
# the hook through which the store saves position-decoupled KV.
KVSink = Callable[[int, torch.Tensor, torch.Tensor, ForwardBatch], None]

ATTENTION_BACKENDS = ("auto", "reference")


@dataclass
class LayerWeights:
    # Projections are held transposed ([in, out] views of HF's [out, in] weights, no copy):
    # `x @ w` is the very mm that F.linear dispatches to, minus its per-call transpose.
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [H, (Hq + 2 Hkv) D]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor  # [Hq D, H]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [H, 2 I]
    down: torch.Tensor  # [I, H]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as transformers' LlamaRMSNorm: normalise in fp32, scale in the input dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class ModelRunner:
    def __init__(
        self, hf_model: Any, spec: ModelSpec, kv_cache: PagedKVCache, attention: str = "auto"
    ) -> None:
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
        self.spec = spec
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = kv_cache.device
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        self.lm_head = hf_model.lm_head.weight.detach().t()  # [H, V]
        self.dtype = self.embed.dtype
        if kv_cache.dtype != self.dtype:
            raise ValueError(
                f"KV cache dtype {kv_cache.dtype} differs from model dtype {self.dtype}"
            )
        self.layers = [self._layer_weights(layer) for layer in inner.layers]
        self.rope = RotaryEmbedding(hf_model.config, spec.head_dim, self.device)
        self.scale = spec.head_dim**-0.5

    @staticmethod
    def _layer_weights(layer: Any) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=qkv.t(),
            qkv_bias=bias,
            o_proj=attn.o_proj.weight.detach().t(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().t(),
            down=mlp.down_proj.weight.detach().t(),
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
        spec = self.spec
        h = F.embedding(batch.input_ids, self.embed)  # [T, H]
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w.input_norm, spec.rms_norm_eps)
            qkv = torch.mm(x, w.qkv) if w.qkv_bias is None else torch.addmm(w.qkv_bias, x, w.qkv)
            v = qkv[:, q_dim + kv_dim :].view(-1, spec.num_kv_heads, spec.head_dim)  # [T, Hkv, D]
            if kv_sink is not None:
                k = qkv[:, q_dim : q_dim + kv_dim].view(-1, spec.num_kv_heads, spec.head_dim)
                kv_sink(i, k, v, batch)
            # q and k rotated together: one set of RoPE ops a layer instead of two.
            qk = qkv[:, : q_dim + kv_dim].view(
                -1, spec.num_heads + spec.num_kv_heads, spec.head_dim
            )
            q, k = apply_rope(qk, cos, sin).split([spec.num_heads, spec.num_kv_heads], dim=1)
            self.kv_cache.write(i, k, v, batch.slot_mapping)
            if layer_ready is not None:
                layer_ready(i)
            attn = self._attention(i, q, k, v, batch)  # [T, Hq, D]
            h = h + torch.mm(attn.reshape(-1, q_dim), w.o_proj)
            x = rms_norm(h, w.post_norm, spec.rms_norm_eps)
            gate, up = torch.mm(x, w.gate_up).chunk(2, dim=-1)
            h = h + torch.mm(F.silu(gate) * up, w.down)
        h = rms_norm(h.index_select(0, batch.logits_indices), self.final_norm, spec.rms_norm_eps)
        return torch.mm(h, self.lm_head).float()

    def _attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.k(layer), self.kv_cache.v(layer)
        if self.attention == "auto":
            if batch.decode_plan is not None:
                return paged_decode(q, k_cache, v_cache, batch.decode_plan, self.scale)
            if batch.num_seqs == 1 and batch.query_lens[0] == batch.context_lens[0]:
                # A fresh sequence: its whole KV is the k, v just computed; no gather needed.
                return attend(q, k, v, self.scale)
        return paged_attention_reference(
            q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.query_lens,
            batch.context_lens,
            self.scale,
        )
