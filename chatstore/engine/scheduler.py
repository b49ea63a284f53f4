"""Iteration-level (continuous) batching with chunked prefill, FCFS, and preemption.

Every step, with a budget of `max_tokens_per_step` tokens (`max_prefill_tokens_per_step` when no
running sequence decodes in it, so no reply waits on the step):

    1. running sequences, decodes first (1 token each), then prefill chunks of the rest; when the
       pool is short, the most recently started sequence is preempted (recompute: blocks dropped,
       back to the head of the waiting queue; swap: KV copied to host, to the swapped queue)
    2. if nothing was preempted: swapped sequences come back first (FCFS)
    3. then waiting requests are admitted while blocks, budget and `max_running` allow:
       preempted ones first, then round-robin by tenant, FCFS within a tenant (WaitingQueue);
       the head that does not fit blocks the queue (no overtaking, so a big request is not
       starved by small ones). A request that cannot fit into an otherwise empty pool fails
       instead of waiting forever.

Finish first (`finish_first_tokens`): once a prompt's prefill completes in a step that carries
no decodes and already holds that many tokens, the step takes no further prompt tokens. Prompts
that arrive together at an idle engine are then answered one step apart, the first after its own
prefill, where packing them into one step would answer all after all of them; the work is the
same. A step that carries decodes (a busy server's usual step) is packed as before: there the
budget a cap would leave unused is throughput every waiting prompt pays for.

The waiting queue is readable from other threads (`waiting_sessions`, in admission order): the
store's placement (prefetch, eviction) and the connector's read buffer (staging) look ahead
through it, as the `QueueLookahead` of chatstore/store/ports.py.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from chatstore.engine.block_manager import BlockManager
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.kv_connector import KVConnector
from chatstore.engine.sequence import Sequence, SequenceStatus
from chatstore.engine.swap import HostSwapSpace
from chatstore.engine.waiting_queue import WaitingQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WaitingEntry:
    """One queued request, as the KV store's look-ahead window sees it."""

    request_id: str
    tenant: str
    session_id: str | None
    num_prompt_tokens: int
    started: bool = False  # part of it is computed already (its KV is in the pool)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step, from seq.num_computed on


@dataclass(frozen=True)
class KVLoad:
    """Prompt tokens [start, start + num_tokens) the connector writes before the prefill."""

    seq: Sequence
    start: int
    num_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockManager,
        swap: HostSwapSpace | None,
        connector: KVConnector | None,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.swap = swap
        self.connector = connector
        self.waiting = WaitingQueue(config)  # pushed to from the API thread
        self.running: list[Sequence] = []  # in the order they (re)started
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self._scheduled: dict[int, ScheduledSeq] = {}
        self._budget = 0
        self._step_tokens = 0  # this step's budget as it began
        self._prompt_finished = False  # a prompt's prefill completes in this step
        self._decoding = False  # this step carries decodes

    # -- queues --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new request's first sequence (any thread); raises EngineOverloadedError when
        the queue, or its tenant's share of it, is full."""
        self.waiting.push(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling joins the batch right away (it shares its parent's blocks)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it; host blocks are freed here."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        else:
            self.waiting.remove(seq)
        if seq.host_blocks and self.swap is not None:
            self.swap.free(seq.host_blocks)
            seq.host_blocks = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def waiting_sessions(self, limit: int | None = None) -> list[WaitingEntry]:
        """Thread-safe snapshot of the waiting queue, in the order requests will be admitted:
        the requests of its first `limit` sequences (all when None), once each."""
        entries: dict[str, WaitingEntry] = {}
        for s in self.waiting.snapshot(limit):
            r = s.request
            if r.request_id not in entries:
                entries[r.request_id] = WaitingEntry(
                    r.request_id, r.tenant, r.session_id, s.num_prompt_tokens, s.num_computed > 0
                )
        return list(entries.values())

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._scheduled = {}
        preemptions_before = self.num_preemptions
        was_idle = not self.running and not self.swapped
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        decoding = bool(decodes) or any(s.num_uncomputed == 1 for s in self.swapped)
        self._budget = self._step_tokens = self.config.step_budget(decoding)
        self._prompt_finished, self._decoding = False, decoding
        for seq in decodes + [s for s in self.running if s.num_uncomputed > 1]:
            held_back = seq.num_uncomputed > 1 and self._finished_first()
            if seq.status is SequenceStatus.RUNNING and self._budget > 0 and not held_back:
                self._schedule_running(seq, out)
        if self.num_preemptions == preemptions_before:
            self._resume_swapped(out)
            if not self.swapped and (self.config.batching == "continuous" or was_idle):
                self._admit_waiting(out)
        out.scheduled = list(self._scheduled.values())
        return out

    def _schedule_running(self, seq: Sequence, out: SchedulerOutput) -> None:
        n = min(seq.num_uncomputed, self._budget)
        target = self._target(seq, seq.num_computed + n)
        while not self.blocks.can_reserve(seq, target):
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self.running.remove(seq)
                out.failed.append((seq, self._too_big(seq, target)))
                return
            self._preempt(victim)
            if victim is seq:
                return
        self.blocks.reserve(seq, target)
        self._put(seq, n)

    def _resume_swapped(self, out: SchedulerOutput) -> None:
        assert self.swap is not None or not self.swapped
        while self.swapped and len(self.running) < self.config.max_running:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed, self._budget)
            target = self._target(seq, seq.num_computed + n)
            if not self.blocks.can_reserve(seq, target):
                if not self.running:
                    self.swapped.popleft()
                    out.failed.append((seq, self._too_big(seq, target)))
                    continue
                return
            self.swapped.popleft()
            self.blocks.reserve(seq, target)
            assert self.swap is not None
            self.swap.swap_in(seq.host_blocks, seq.block_table[: len(seq.host_blocks)])
            seq.host_blocks = []
            self.add_running(seq)
            if n > 0:
                self._put(seq, n)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        static = self.config.batching == "static"
        while len(self.running) < self.config.max_running and (self._budget > 0 or static):
            if not static and self._finished_first():
                return
            seq = self.waiting.peek()
            if seq is None or not self._admit(seq, out):
                return

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Try to start the head of the queue; False when it must wait for blocks."""
        hit = self.blocks.lookup(seq)
        hit_tokens = len(hit) * self.blocks.block_size
        external = self._external_tokens(seq, hit_tokens)
        computed = hit_tokens + external
        n = min(seq.num_tokens - computed, self._budget)
        target = self._target(seq, computed + n)
        if (self.running or self.swapped) and not self._room_to_finish(seq, hit):
            return False
        if not self.blocks.can_reserve(seq, target, hit):
            if self.running or self.swapped:
                return False
            self.waiting.pop(seq)
            out.failed.append((seq, self._too_big(seq, target)))
            return True
        self.waiting.pop(seq)
        self.blocks.count_lookup(seq, hit)
        self.blocks.reserve(seq, target, hit)
        if external:
            out.loads.append(KVLoad(seq, hit_tokens, external))
            seq.num_computed = computed
        if not seq.group.admitted:
            seq.group.admitted = True
            seq.group.cached_tokens = computed
            seq.group.cached_by_tier = self._cached_by_tier(hit_tokens, external)
        self.add_running(seq)
        if n > 0:
            self._put(seq, n)
        return True

    def _room_to_finish(self, seq: Sequence, hit: list[int]) -> bool:
        """With `admission_reserve_tokens` (see engine_config.py): whether the pool holds the
        whole prompt of `seq` and of every running sequence, each with that many tokens of
        output (at most what it may still generate), besides the blocks they hold already."""
        reserve = self.config.admission_reserve_tokens
        if reserve <= 0 or self.config.kv_reservation != "paged":
            return True
        need = self.blocks.blocks_needed(seq, self._finish_tokens(seq, reserve), hit)
        for other in self.running:
            need += self.blocks.blocks_needed(other, self._finish_tokens(other, reserve))
        return need <= self.blocks.pool.num_free

    @staticmethod
    def _finish_tokens(seq: Sequence, reserve: int) -> int:
        """Tokens a sequence holds once its prompt is computed and `reserve` more are out."""
        left = max(0, seq.request.sampling.max_tokens - seq.num_output_tokens)
        return max(seq.num_tokens, seq.num_prompt_tokens) + min(reserve, left)

    @staticmethod
    def _cached_by_tier(hit_tokens: int, external: int) -> dict[str, int]:
        """The reused prompt tokens by where their KV was: the device prefix cache, then the
        connector's store (which of its tiers, the API reads from the turn's handle)."""
        split = {"device": hit_tokens} if hit_tokens else {}
        if external:
            split["store"] = external
        return split

    def _external_tokens(self, seq: Sequence, hit_tokens: int) -> int:
        if self.connector is None or hit_tokens >= seq.num_prompt_tokens:
            return 0
        try:
            ext = int(self.connector.num_external_tokens(seq.request, hit_tokens))
        except Exception:
            log.exception("connector.num_external_tokens failed; computing the prompt instead")
            return 0
        limit = min(seq.num_prompt_tokens, seq.num_tokens - 1) - hit_tokens
        return max(0, min(ext, limit))

    def _preempt(self, seq: Sequence) -> None:
        """Newest first: recompute drops the KV; swap copies it to host (recompute if full)."""
        self.running.remove(seq)
        dropped = self._scheduled.pop(seq.seq_id, None)
        if dropped is not None:
            self._budget += dropped.num_tokens
        self.num_preemptions += 1
        bs = self.blocks.block_size
        used = seq.block_table[: (seq.num_computed + bs - 1) // bs]
        if (
            self.config.preemption_mode == "swap"
            and self.swap
            and self.swap.can_swap_out(len(used))
        ):
            seq.host_blocks = self.swap.swap_out(used) if used else []
            self.blocks.free(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            return
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.push_front(seq)

    def _put(self, seq: Sequence, n: int) -> None:
        if n > 1 and n == seq.num_uncomputed:  # the rest of a prompt: its first token comes next
            self._prompt_finished = True
        self._scheduled[seq.seq_id] = ScheduledSeq(seq, n)
        self._budget -= n

    def _finished_first(self) -> bool:
        """Whether this step takes no more prompt tokens: it carries no decodes, a prompt
        finishes in it and it holds `finish_first_tokens` already (see the module doc)."""
        least = self.config.finish_first_tokens
        held = self._step_tokens - self._budget
        return least > 0 and not self._decoding and self._prompt_finished and held >= least

    def _target(self, seq: Sequence, num_tokens: int) -> int:
        """Tokens to hold blocks for: what is computed now, or (kv_reservation = "max") the
        request's whole maximum length, reserved at admission."""
        if self.config.kv_reservation == "paged":
            return num_tokens
        reserve = self.config.max_model_len
        if reserve <= 0:
            reserve = seq.num_prompt_tokens + seq.request.sampling.max_tokens
        return max(num_tokens, reserve)

    def _too_big(self, seq: Sequence, num_tokens: int) -> str:
        need = self.blocks.blocks_needed(seq, num_tokens)
        return (
            f"request needs {need} KV blocks for {num_tokens} tokens but the pool has "
            f"{self.blocks.pool.num_blocks} blocks of {self.blocks.block_size} tokens"
        )
