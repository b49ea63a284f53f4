"""The synchronous engine: one `step()` = schedule -> load -> forward -> sample -> outputs.

Not thread-safe except `add_request`, `abort_request`, `waiting_sessions` and `stats`, which the
API thread may call while the model thread runs `step()` (`AsyncEngine` does exactly that).
Aborts are queued and applied by the model thread at the start of the next step, so every
block and connector call is handled by one thread.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque

import torch

from chatstore.engine.batch_forward import BatchForward
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.engine_stats import EngineStats
from chatstore.engine.kv_cache import bytes_per_block
from chatstore.engine.kv_connector import KVConnector, NullConnector
from chatstore.engine.request import FinishReason, InvalidRequestError, Request, RequestOutput
from chatstore.engine.request_checks import check_request
from chatstore.engine.runtime import Runtime
from chatstore.engine.sampling import sample_batch
from chatstore.engine.scheduler import ScheduledSeq, Scheduler, WaitingEntry
from chatstore.engine.sequence import RequestState, Sequence, SequenceStatus
from chatstore.engine.step_loads import StepLoads
from chatstore.engine.swap import HostSwapSpace

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, runtime: Runtime, config: EngineConfig, connector: KVConnector | None = None
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.spec = runtime.model.spec
        self.tokenizer = runtime.model.tokenizer
        self.connector: KVConnector = connector or NullConnector()
        self.blocks = runtime.layout.block_manager(runtime.pool, config.enable_prefix_cache)
        kv_cache = runtime.kv_cache
        self.block_bytes = bytes_per_block(kv_cache.spec, kv_cache.block_size, kv_cache.dtype)
        self.swap = None
        if config.preemption_mode == "swap":
            self.swap = HostSwapSpace(runtime.kv_cache, config.swap_space_bytes)
        store = self.connector if self.connector.saves_kv else None
        self.scheduler = Scheduler(config, self.blocks, self.swap, store)
        self._forward = BatchForward(runtime, config, self.blocks, self.connector)
        self.connector.set_waiting_queue(self)  # its read buffer stages who runs next
        self._groups: dict[str, RequestState] = {}
        self._aborts: deque[str] = deque()
        self._seq_ids = itertools.count()
        self.steps = self.tokens_computed = self.tokens_generated = 0
        self.requests_finished = self._seqs_stepped = 0

    # -- API-thread entry points ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Validate and queue; raises InvalidRequestError / EngineOverloadedError."""
        self._validate(request)
        group = RequestState(request, tokenizer=self.tokenizer)
        seq = Sequence(next(self._seq_ids), group, 0)
        group.seqs.append(seq)
        self._groups[request.request_id] = group
        try:
            self.scheduler.add(seq)
        except Exception:
            del self._groups[request.request_id]
            raise

    def abort_request(self, request_id: str) -> None:
        self._aborts.append(request_id)

    def has_work(self) -> bool:
        return bool(self._aborts) or self.scheduler.has_work()

    def waiting_sessions(self, limit: int | None = None) -> list[WaitingEntry]:
        return self.scheduler.waiting_sessions(limit)

    def stats(self) -> EngineStats:
        pool, cache = self.runtime.pool, self.blocks.stats()
        return EngineStats(
            waiting=self.scheduler.num_waiting,
            running=len(self.scheduler.running),
            swapped=len(self.scheduler.swapped),
            num_blocks=pool.num_blocks,
            free_blocks=pool.num_free,
            block_size=self.blocks.block_size,
            cached_blocks=cache.cached_blocks,
            cached_tokens=cache.cached_blocks * self.blocks.block_size,
            evictable_blocks=cache.evictable_blocks,
            prefix_hits=cache.hit_blocks,
            prefix_misses=cache.miss_blocks,
            prefix_evictions=cache.evictions,
            steps=self.steps,
            preemptions=self.scheduler.num_preemptions,
            swapped_out_blocks=self.swap.swapped_out if self.swap else 0,
            swapped_in_blocks=self.swap.swapped_in if self.swap else 0,
            tokens_computed=self.tokens_computed,
            tokens_generated=self.tokens_generated,
            requests_finished=self.requests_finished,
            mean_batch_size=self._seqs_stepped / self.steps if self.steps else 0.0,
            load=self.connector.load_stats(),
            block_bytes=self.block_bytes,
            cached_sessions=cache.sessions,
        )

    # -- the model thread ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        self._apply_aborts(touched)
        plan = self.scheduler.schedule()
        for seq, message in plan.failed:
            self._finish_group(seq.group, "error", message, touched)
        loads = StepLoads(self.connector)  # joined in this step, before any block is freed
        for group, exc in loads.start(plan.loads):
            self._load_failed(group, exc, touched)
        self._look_ahead()
        items = [s for s in plan.scheduled if not s.seq.finished]
        if items:
            self._run_step(items, touched, loads)
        else:
            self._finish_loads(touched, loads)
        outputs = [self._make_output(g) for g in touched.values()]
        return [o for o in outputs if o is not None]

    def _look_ahead(self) -> None:
        """The read buffer: the next jobs' KV staged during this one (a hint: errors pass)."""
        try:
            self.connector.look_ahead()
        except Exception:
            log.exception("connector.look_ahead failed")

    def _load_failed(self, group: RequestState, exc: Exception, touched) -> None:
        log.error("KV load failed for %s", group.request_id, exc_info=exc)
        self._finish_group(group, "error", f"KV load failed: {exc}", touched)

    def _finish_loads(self, touched: dict[str, RequestState], loads: StepLoads) -> None:
        """Join the step's pre-loads; a request whose load failed ends with an error."""
        for rid, error in loads.finish().items():
            group = self._groups.get(rid)
            if group is not None:
                self._load_failed(group, error, touched)

    def _run_step(
        self,
        items: list[ScheduledSeq],
        touched: dict[str, RequestState],
        loads: StepLoads,
    ) -> None:
        try:
            logits = self._forward(items, loads.layer_ready)
        except Exception as exc:
            log.exception("forward of %d sequences failed", len(items))
            self._finish_loads(touched, loads)  # before any of their blocks is freed
            self._isolate(items, exc, touched)
            return
        self._finish_loads(touched, loads)
        self._advance(items, logits, touched)

    def _isolate(
        self, items: list[ScheduledSeq], exc: Exception, touched: dict[str, RequestState]
    ) -> None:
        """A forward of `items` raised: run each half again on its own, so that only a sequence
        that fails alone ends with the error and the rest of the batch (other tenants) goes on.
        Nothing was committed (num_computed, prefix cache): a retry rewrites the same KV slots,
        and the store's saver keeps the last row written per position. At most
        2 * len(items) - 1 forwards in all."""
        live = [it for it in items if not it.seq.finished]
        if len(live) == 1:
            log.error("request %s fails alone: %s", live[0].seq.group.request_id, exc)
            self._finish_group(live[0].seq.group, "error", f"engine error: {exc}", touched)
            return
        mid = len(live) // 2
        for half in (live[:mid], live[mid:]):
            half = [it for it in half if not it.seq.finished]  # a sibling sample failed
            if not half:
                continue
            try:
                logits = self._forward(half)
            except Exception as half_exc:
                self._isolate(half, half_exc, touched)
                continue
            self._advance(half, logits, touched)

    def _advance(
        self, items: list[ScheduledSeq], logits: torch.Tensor, touched: dict[str, RequestState]
    ) -> None:
        """Commit a forward: computed tokens, prefix-cache blocks, then sample the new tokens."""
        self.steps += 1
        self._seqs_stepped += len(items)
        to_sample: list[tuple[Sequence, int]] = []
        for row, it in enumerate(items):
            seq = it.seq
            if seq.finished:  # its KV pre-load failed: the row is garbage, nothing to keep
                continue
            seq.num_computed += it.num_tokens
            self.tokens_computed += it.num_tokens
            self.blocks.register_computed(seq)
            if seq.num_computed == seq.num_tokens:
                to_sample.extend((s, row) for s in self._fork(seq))
        if not to_sample:
            return
        rows = [row for _, row in to_sample]
        if rows != list(range(len(logits))):  # not every row once in order: copy [rows, V]
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        seqs = [s for s, _ in to_sample]
        for seq, token in zip(seqs, self._sample(logits, seqs, touched), strict=True):
            if token is not None and not seq.finished:
                self._append(seq, token)
                touched[seq.group.request_id] = seq.group

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], touched: dict[str, RequestState]
    ) -> list[int | None]:
        """A token per row of logits [len(seqs), V]; when the batch raises, each row alone, and
        a row that still raises ends its request with the error (None)."""
        try:
            return list(sample_batch(logits, [s.sample for s in seqs]))
        except Exception:
            log.exception("sampling %d sequences failed; sampling them one by one", len(seqs))
        tokens: list[int | None] = []
        for row, seq in enumerate(seqs):
            try:
                tokens.append(sample_batch(logits[row : row + 1], [seq.sample])[0])
            except Exception as exc:
                self._finish_group(seq.group, "error", f"sampling failed: {exc}", touched)
                tokens.append(None)
        return tokens

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """When a request's prompt is computed: its n samples, sharing the prompt's blocks."""
        group = seq.group
        if group.forked:
            return [seq]
        group.forked = True
        for k in range(1, group.request.sampling.n):
            child = seq.fork(next(self._seq_ids), k)
            self.blocks.fork(seq, child)
            group.seqs.append(child)
            self.scheduler.add_running(child)
        return list(group.seqs)

    def _append(self, seq: Sequence, token: int) -> None:
        params = seq.request.sampling
        seq.group.note_first_token()
        self.tokens_generated += 1
        eos = token in self.spec.eos_token_ids and not params.ignore_eos
        stop_token = eos or token in params.stop_token_ids
        stopped = seq.append_token(token, emit_text=not stop_token)
        if stopped or stop_token:
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= params.max_tokens or self._context_full(seq):
            self._finish(seq, "length")

    def _context_full(self, seq: Sequence) -> bool:
        return seq.num_tokens >= self.spec.max_context

    # -- endings -------------------------------------------------------------------------------
    def _apply_aborts(self, touched: dict[str, RequestState]) -> None:
        while self._aborts:
            group = self._groups.get(self._aborts.popleft())
            if group is not None:
                self._finish_group(group, "abort", None, touched)

    def _finish_group(
        self,
        group: RequestState,
        reason: FinishReason,
        error: str | None,
        touched: dict[str, RequestState],
    ) -> None:
        if error is not None and group.error is None:
            group.error = error
        for seq in group.seqs:
            self._finish(seq, reason)
        touched[group.request_id] = group

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End one sample: tell the store (sample 0), then release its blocks."""
        if seq.finished:
            return
        if reason in ("stop", "length", "abort"):
            seq.flush_text()
        self.scheduler.remove(seq)
        if seq.sample_index == 0:
            bs = self.blocks.block_size
            table = seq.block_table[: (seq.num_computed + bs - 1) // bs]
            try:
                self.connector.request_finished(
                    seq.request, seq.token_ids[: seq.num_computed], table
                )
            except Exception:
                log.exception("connector.request_finished failed")
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.group.forked = True  # a request ended before its first token never forks

    def _make_output(self, group: RequestState) -> RequestOutput | None:
        samples = [d for d in (s.take_delta() for s in group.seqs) if d is not None]
        finished = group.finished
        if not samples and not finished:
            return None
        if finished:
            self._groups.pop(group.request_id, None)
            self.requests_finished += 1
        return RequestOutput(
            request_id=group.request_id,
            samples=samples,
            finished=finished,
            usage=group.usage() if finished else None,
            error=group.error if finished else None,
            first_token_time=group.first_token_time,
        )

    def _validate(self, request: Request) -> None:
        check_request(
            request, self.spec, self.config, self.runtime.pool.num_blocks, self.blocks.block_size
        )
        if request.request_id in self._groups:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
