"""A request's admission read: how much of its prompt the store's history covers, and that
history past the device prefix-cache hit, read on the engine thread from host memory only.

    request (Request.store_turn: the API's OpenedTurn, or None)
      │  store.prepare_load: the stored history (no KV read), each chunk's tier as the turn
      │                      found it, a prompt prefix the opening borrowed, its version
      │  read buffer: a staged copy of the session, claimed if it is that version
      ▼
    PendingTurn  reusable = the history's common prefix with the prompt, less one token (its
                 logits give the first new token)
      │  read_available(start): the chunks past `start`, from host memory only
      │                         (`store.load_history`; the turn's pins go once read)
      ▼
    ChunkedKV    what the load rotates into the pool; a chunk only SSD or Redis holds ends the
                 reuse there (recomputed) and is prefetched to DRAM for the next turn, rather
                 than make the step wait on a disk or the network
"""

from __future__ import annotations

from dataclasses import dataclass

from chatstore.engine.request import Request
from chatstore.store.ports import KVSource, OpenedTurn, StoredSession
from chatstore.store.session_kv import SessionKey, common_prefix_len
from chatstore.transfer.chunked_kv import ChunkedKV
from chatstore.transfer.read_buffer import ReadBuffer, StagedKV


@dataclass
class PendingTurn:
    """What the connector keeps of an admitted request until it ends."""

    request: Request
    saved: StoredSession | None
    reusable: int  # leading prompt tokens the stored chunks cover (LCP)
    staged: StagedKV | None = None  # read-buffer entry claimed for this request
    kv: ChunkedKV | None = None  # the chunks past the device hit, read at admission
    opened: OpenedTurn | None = None  # the API's handle: its pinned chunks, until read


class TurnAdmission:
    """The engine thread's side of a turn's history (see the module's doc)."""

    def __init__(self, store: KVSource, read_buffer: ReadBuffer) -> None:
        self.store, self.read_buffer = store, read_buffer

    def start(self, request: Request) -> PendingTurn:
        saved, staged, opened = None, None, OpenedTurn.of(request.store_turn)
        if request.session_id is not None:
            key = SessionKey(request.tenant, request.session_id)
            saved = self.store.prepare_load(key.tenant, key.session_id, opened)
            if saved is not None and saved.version is not None:  # published copies only
                staged = self.read_buffer.claim(key, saved.version)
        reusable = 0
        if saved is not None:
            # Keep at least one prompt token to compute: its logits give the first new token.
            lcp = common_prefix_len(saved.token_ids, request.prompt_token_ids)
            reusable = min(lcp, len(request.prompt_token_ids) - 1)
        if staged is not None and (staged.saved is None or staged.saved.end < reusable):
            self.read_buffer.release(staged)
            staged = None
        return PendingTurn(request, saved, reusable, staged, opened=opened)

    def read_available(self, pending: PendingTurn, start: int) -> ChunkedKV | None:
        """The history [start, reusable) from host memory (`store.load_history`, which lets
        the turn's pins go); `pending.reusable` shrinks to where a chunk is missing (gone,
        corrupt, or only below host memory)."""
        stored = pending.saved
        assert stored is not None
        parts, reached = self.store.load_history(stored, start, pending.reusable, pending.opened)
        pending.reusable = reached  # a chunk that is gone: reuse stops where it starts
        if reached <= start:
            return None
        return ChunkedKV(parts, start, reached, stored.token_ids)
