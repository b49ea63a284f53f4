"""Context overflow (CachedAttention §3.4, Table 1): perplexity of a continuation after the oldest
history is dropped, three ways, with the real default model on a public-domain English text.

    TT    token truncation: drop the tokens, recompute the kept history's KV (the reference)
    CA    ours: the saved pre-RoPE KV is cut the same way and rotated to the new positions
    NKVT  naive KV truncation: the same cut on KV whose RoPE was baked in at the old positions

Each window: a title (the "system prompt", kept) + HISTORY tokens saved as one turn, then a turn
that adds CONTINUATION tokens and overflows the MAX_CONTEXT window: the store drops half the
window after the title, and the continuation refills it (what a conversation does until its next
overflow). PPL is over the continuation, pooled over windows that tile the text.
CA must not be worse than TT by more than 1%; NKVT must be far worse (the paper: 5.47 / 5.48 /
2198.7). Truncation drops whole chunks, so the title's chunk keeps a few history tokens; the KV
kept after the cut was computed with the dropped text in view, which makes CA slightly *better*
than TT here (measured: pooled PPL 29.94 vs 30.95), never worse.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from chatstore.engine.block_pool import BlockPool
from chatstore.engine.forward_batch import ForwardBatch, SequenceChunk
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.request import Request
from chatstore.engine.runner import ModelRunner
from chatstore.store.attention_store import AttentionStore
from chatstore.store.settings import StoreSettings
from chatstore.transfer import StoreConnector

pytestmark = [pytest.mark.model, pytest.mark.slow]

TEXT = Path(__file__).parents[1] / "data" / "declaration_and_lincoln.txt"
BLOCK = 16
MAX_CONTEXT = 1024
HISTORY = 900
CONTINUATION = 600  # the next segment refills the window after the cut (408 kept + 600 < 1024)
WINDOWS = (0, 1350)  # token offsets into the text body (2870 tokens)


class Rig:
    def __init__(self, model, data_dir: Path) -> None:
        self.model = model
        num_blocks = 3 * (MAX_CONTEXT + HISTORY + CONTINUATION) // BLOCK
        self.cache = PagedKVCache(model.spec, num_blocks, BLOCK, model.dtype)
        self.pool = BlockPool(num_blocks)
        self.runner = ModelRunner(model.weights, model.spec, self.cache)
        settings = StoreSettings(
            data_dir=data_dir, dram_bytes=256 << 20, ssd_bytes=0, max_context_tokens=MAX_CONTEXT
        )
        self.store = AttentionStore(settings, model.spec, model.fingerprint)
        self.conn = StoreConnector(self.store, self.cache, self.runner.rope)

    def blocks(self, n: int) -> list[int]:
        return self.pool.allocate(-(-n // BLOCK))

    def forward(self, chunk: SequenceChunk, sink=None) -> torch.Tensor:
        batch = ForwardBatch.build([chunk], BLOCK, all_logits=True)
        return self.runner.forward(batch, kv_sink=sink)


def _nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Summed NLL of targets [n] under logits [n, V]."""
    loss = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(targets), reduction="sum")
    return float(loss)


def _window(rig: Rig, head: list[int], history: list[int], cont: list[int], sid: str):
    conn, store = rig.conn, rig.store
    first = head + history
    req = Request(f"{sid}-1", first, tenant="t", session_id=sid)
    assert conn.num_external_tokens(req, 0) == 0
    old_blocks = rig.blocks(len(first))
    conn.begin_step([req.request_id])
    rig.forward(SequenceChunk(first, 0, old_blocks), conn.save_layer)
    conn.request_finished(req, first, old_blocks)

    # The next turn overflows: the store plans the cut and applies it to prompt and saved KV.
    prompt = store.fit_context("t", sid, first + cont, head=len(head), tail=len(cont))
    drop = len(first + cont) - len(prompt)
    # Whole chunks go: the title's chunk stays whole, the cut is a multiple of a chunk.
    C = store.settings.chunk_tokens
    head_c = -(-len(head) // C) * C
    assert drop % C == 0 and drop >= MAX_CONTEXT // 2
    assert prompt == first[:head_c] + first[head_c + drop :] + cont
    kept = len(prompt) - len(cont)
    targets = cont[1:]

    # TT: recompute everything that is kept.
    tt = _nll(rig.forward(SequenceChunk(prompt, 0, rig.blocks(len(prompt))))[kept:-1], targets)

    # CA: the connector loads the cut KV rotated to its new positions; only `cont` is computed.
    req2 = Request(f"{sid}-2", prompt, tenant="t", session_id=sid)
    assert conn.num_external_tokens(req2, 0) == kept
    ca_blocks = rig.blocks(len(prompt))
    conn.load(req2, 0, kept, ca_blocks)
    ca = _nll(rig.forward(SequenceChunk(cont, kept, ca_blocks))[:-1], targets)
    conn.forget(req2.request_id)

    # NKVT: the post-RoPE KV of the kept tokens, still rotated at their old positions, as is.
    old = torch.tensor(list(range(head_c)) + list(range(head_c + drop, len(first))))
    nk_blocks = rig.blocks(len(prompt))
    spec = rig.model.spec
    flat = rig.cache.kv.view(spec.num_layers, 2, -1, spec.num_kv_heads, spec.head_dim)
    flat[:, :, _slots(nk_blocks, torch.arange(kept))] = flat[:, :, _slots(old_blocks, old)]
    nkvt = _nll(rig.forward(SequenceChunk(cont, kept, nk_blocks))[:-1], targets)
    return tt, ca, nkvt, len(targets), drop, kept


def _slots(blocks: list[int], positions: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(blocks)
    return table[positions // BLOCK] * BLOCK + positions % BLOCK


def test_decoupled_truncation_matches_recompute(default_model, tmp_path):
    tok = default_model.tokenizer
    text = TEXT.read_text()
    title, body = text[text.index("In Congress") :].split("\n\n", 1)
    head, ids = tok.encode(title + "\n\n"), tok.encode(body)
    assert len(ids) >= WINDOWS[-1] + HISTORY + CONTINUATION
    totals = [0.0, 0.0, 0.0]
    count = 0
    rows = []
    for i, offset in enumerate(WINDOWS):
        rig = Rig(default_model, tmp_path / str(i))
        history = ids[offset : offset + HISTORY]
        cont = ids[offset + HISTORY : offset + HISTORY + CONTINUATION]
        tt, ca, nkvt, n, drop, kept = _window(rig, head, history, cont, f"w{i}")
        rig.store.close()
        totals = [totals[0] + tt, totals[1] + ca, totals[2] + nkvt]
        count += n
        rows.append(
            f"| window at token {offset} | {math.exp(tt / n):.3f} | "
            f"{math.exp(ca / n):.3f} | {math.exp(nkvt / n):.1f} |"
        )
    tt, ca, nkvt = (math.exp(t / count) for t in totals)
    print(
        f"\ntruncation PPL: window {MAX_CONTEXT}, {drop} tokens dropped after the title, "
        f"{kept} kept, PPL of the next {CONTINUATION - 1} tokens\n"
        "| | TT (recompute) | CA (decoupled KV, ours) | NKVT (naive KV truncation) |\n"
        "|---|---|---|---|\n" + "\n".join(rows) + f"\n| **pooled** | **{tt:.3f}** | "
        f"**{ca:.3f}** | **{nkvt:.1f}** |"
    )
    assert ca <= tt * 1.01
    assert nkvt > 2 * tt
