"""Test helpers for the store: a tiny model's shapes, and states only pressure would bring about."""

from __future__ import annotations

from chatstore.model.spec import ModelSpec
from chatstore.store.attention_store import AttentionStore
from chatstore.store.session_kv import SessionKey

# A two-layer model's shapes, for stores tested without a model (KV of random values).
TINY_SPEC = ModelSpec(
    architecture="LlamaForCausalLM",
    num_layers=2,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    num_kv_heads=2,
    head_dim=4,
    vocab_size=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_type="default",
    max_position_embeddings=256,
    qkv_bias=False,
    tie_word_embeddings=False,
    sliding_window=None,
    eos_token_ids=(1,),
)


def push_down(store: AttentionStore, tenant: str, session_id: str) -> None:
    """The session's chunks leave DRAM as an eviction would leave them: on SSD only."""
    store.wait_saved(tenant, session_id)
    chain = store.index.get(SessionKey(tenant, session_id))
    assert chain is not None, f"{tenant}/{session_id} holds no chunks"
    for chunk in chain.chunks:
        assert store.tiers.persist(chunk), f"chunk {chunk} did not reach SSD"
        with store.tiers.lock:
            store.tier("dram").delete(chunk)
