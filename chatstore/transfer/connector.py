"""StoreConnector: the engine's KVConnector backed by the AttentionStore.

    turn n+1 prompt  [ device hit | stored chunks beyond it | new tokens ]
                                    loaded: pre-RoPE K rotated | prefill computes these; save_layer
                                    to positions, V as is      | keeps their K, V (LayerSaver)
    request_finished: the turn's tokens -> store.save_turn, which plans their chain and asks
                      for a builder of only its new chunks: from the old tail's rows, the
                      computed rows and (tokens the store never saw) device blocks un-rotated

The lookup at admission (`find`) reads no KV: it answers from memory how many leading tokens
the store holds. Only the chunks past the device prefix-cache hit are read, when the load runs.

Load, three ways (CachedAttention §3.2.1):
  - `load`: every layer, synchronously, before the prefill (no pre-load);
  - `start_load` + `wait_for_layer(i)` + `finish_loads`: the loader thread (LayerLoader) copies
    layer 0, 1, ... while the forward runs; the runner waits right before layer i's attention;
  - with a read buffer (`read_buffer_layers` > 0): `stage(tenant, session)` on a client hint and
    `look_ahead()` after each schedule (the engine's waiting queue; `stage_queued`, by default on
    a GPU only) look the sessions up on the loader's lookup thread and stage their first layers,
    rotated, before their job starts (session_staging.py, ReadBuffer); a job never waits for a
    lookup still running.

Chunks below DRAM (SSD, Redis): the admission read runs on the engine thread, so it reads host
memory only (`store.load_history`: write buffer, held copies, DRAM), never a disk or the
network. The API thread that opened the turn (`store.open_turn`) has brought them up and
pinned them (pinned in DRAM, or kept beside it when DRAM cannot take them or there is no DRAM
tier); its handle rides on the request (`Request.store_turn`, an `OpenedTurn`): the connector
reads the stored history through it (`prepare_load`: each chunk's tier as the turn found it, a
borrowed prompt prefix) and unpins it once the chunks are read (`load_history`, or when the
request ends). Where a chunk only SSD or Redis holds still cuts the reuse (no turn opened it),
the rest is recomputed and
the session is hinted to the store's prefetch thread, which brings its chunks to DRAM for the
next turn (queued sessions' chunks come up ahead of their turn the same way); a staged session
(read buffer) was read on the loader's lookup thread, from any tier.

Save (§3.2.2): save_layer copies each tracked request's rows once per layer (LayerSaver); at the
end of the turn the engine thread copies only what lives in the device pool alone (rows never
seen computed, usually none); assembling the new chunks and writing them to the tiers is handed
to the store's writer thread when the store runs with `async_save`. With int8 storage the rows
wait in the compute dtype and each new chunk is quantised as it is built (kv_quant.py), so the
quantisation runs on the writer thread, never in a forward.

What the engine must give: `num_external_tokens` is called (once or more) for every new request
before `load`; in `save_layer`, the batch's rows must be attributable to requests, either by a
`request_ids: list[str]` attribute on ForwardBatch (one per sequence, in chunk order) or by
calling `begin_step(request_ids)` before each forward. Rows of ids the connector does not know
(no session, or extra samples of n > 1) are ignored.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.kv_connector import KVConnector, LoadStats
from chatstore.engine.request import Request
from chatstore.engine.rope import RotaryEmbedding
from chatstore.store import kv_quant
from chatstore.store.ports import KVSource, OpenedTurn, QueueLookahead
from chatstore.transfer.chunked_kv import ChunkedKV, LazyChunkedKV
from chatstore.transfer.copy_events import compute_mark, layer_events
from chatstore.transfer.layer_loader import LayerLoader, LoadJob
from chatstore.transfer.layer_saver import LayerSaver, TurnRows
from chatstore.transfer.read_buffer import ReadBuffer
from chatstore.transfer.session_staging import SessionStaging
from chatstore.transfer.stored_reads import fetch_session, fetch_span
from chatstore.transfer.turn_admission import PendingTurn, TurnAdmission
from chatstore.transfer.turn_save import TurnSaver, block_slots

log = logging.getLogger(__name__)


class StoreConnector(KVConnector):
    saves_kv = True
    layerwise = True

    def __init__(
        self,
        store: KVSource,
        kv_cache: PagedKVCache,
        rope: RotaryEmbedding,
        layer_delay_s: float = 0.0,
        loader_threads: int | None = 1,
        read_buffer_layers: int = 0,
        read_buffer_bytes: int = 512 << 20,
        stage_queued: bool | None = None,
        inline_loads: bool | None = None,
    ):
        self.store = store
        self.kv_cache = kv_cache
        self.rope = rope
        self._pending: dict[str, PendingTurn] = {}
        self._step_ids: list[str] | None = None
        self.read_buffer = ReadBuffer(read_buffer_layers, read_buffer_bytes)
        self.admission = TurnAdmission(store, self.read_buffer)
        # Staging queued sessions while another job computes pays off when the copy has an
        # engine of its own (a GPU's); on a CPU host it shares the forward's cores and measured
        # a net loss (bench/preload.py, job sequence), so by default only hints stage there.
        if stage_queued is None:
            stage_queued = kv_cache.device.type == "cuda"
        self.loader = LayerLoader(
            kv_cache,
            rope,
            lambda key: fetch_session(store, key),  # the staging read: all its chunks
            self.read_buffer,
            layer_delay_s,
            loader_threads,
            inline=inline_loads,  # None: on CUDA (LayerLoader's docstring says why)
        )
        self.staging = SessionStaging(store, self.read_buffer, self.loader, stage_queued)
        # The dtype the turn's rows wait in until its chunks are built (int8: the compute's).
        self.staging_dtype = kv_quant.staging_dtype(store.storage_dtype, kv_cache.dtype)
        self.saver = LayerSaver(kv_cache.spec.num_layers, self.staging_dtype, kv_cache.device)
        self.turn_saver = TurnSaver(store, kv_cache, rope, self.staging_dtype)
        self._jobs: list[LoadJob] = []  # loads started this step
        self.loads = 0
        self.loads_started = 0  # layer-wise ones
        self.load_wait_s = 0.0  # cumulative time wait_for_layer / finish_loads blocked
        self.staged_layers_used = 0
        # Fewer stored tokens past the device hit than this are computed instead of loaded.
        # 1: load whatever the store has (a few rows of DRAM cost less than computing them).
        self.min_load_tokens = 1
        self.idle = threading.Event()  # clear while a forward with prompt tokens runs
        self.idle.set()
        store.yield_to(self.idle)
        if self.read_buffer.enabled:  # a client's hint stages its session here
            store.add_hint_listener(self.stage)

    @property
    def stage_queued(self) -> bool:
        """Whether queued sessions are staged too (else only hinted ones)."""
        return self.staging.stage_queued

    @stage_queued.setter
    def stage_queued(self, on: bool) -> None:
        self.staging.stage_queued = on

    @property
    def load_copy_s(self) -> float:
        return self.loader.copy_s

    def close(self) -> None:
        self.loader.close()

    def load_stats(self) -> LoadStats:
        buffer = self.read_buffer
        return LoadStats(
            kv_loads=self.loads,
            kv_layerwise_loads=self.loads_started,
            kv_load_wait_s=round(self.load_wait_s, 6),
            kv_load_copy_s=round(self.loader.copy_s, 6),
            read_buffer_layers=buffer.layers,
            read_buffer_staged=buffer.staged,
            read_buffer_hits=buffer.claimed,
            read_buffer_layers_used=self.staged_layers_used,
            read_buffer_bytes=buffer.used_bytes(),
        )

    # -- before the prefill -------------------------------------------------------------------

    def num_external_tokens(self, request: Request, num_computed: int) -> int:
        """Stored tokens past the device hit. Their chunks are read here, so that a chunk that
        is gone or corrupt shortens the reuse (the rest is computed) instead of failing the
        load; only chunks beyond `num_computed` are read at all."""
        pending = self._pending.get(request.request_id) or self._start(request)
        if pending.reusable - num_computed < self.min_load_tokens:
            return 0
        if pending.staged is None and (pending.kv is None or pending.kv.start > num_computed):
            pending.kv = self.admission.read_available(pending, num_computed)
        return max(0, pending.reusable - num_computed)

    def _start(self, request: Request) -> PendingTurn:
        pending = self.admission.start(request)
        self._pending[request.request_id] = pending
        if request.session_id is not None:
            self.saver.track(request.request_id)
        return pending

    def load(self, request: Request, start: int, num_tokens: int, block_table: list[int]) -> None:
        """Synchronous: every layer's history KV is in the pool when this returns."""
        job = self._job(request, start, num_tokens, block_table)
        for layer in range(self.kv_cache.spec.num_layers):
            self.loader.copy_layer(job, layer)
        self._done(job)

    def _job(
        self, request: Request, start: int, num_tokens: int, block_table: list[int]
    ) -> LoadJob:
        pending = self._pending.get(request.request_id)
        end = start + num_tokens
        if pending is None or pending.saved is None or end > pending.reusable:
            raise RuntimeError(f"request {request.request_id}: no saved KV for [{start}, {end})")
        positions = torch.arange(start, end)
        slots = block_slots(block_table, positions, self.kv_cache.block_size).to(
            self.kv_cache.device
        )
        layers = layer_events(self.kv_cache.device, self.kv_cache.spec.num_layers)
        self.loads += 1
        staged, stored, read = pending.staged, pending.saved, pending.kv
        if staged is not None and staged.saved is not None:
            source: ChunkedKV | LazyChunkedKV = staged.saved
        elif read is not None and read.start <= start and end <= read.end:
            source = read
        else:
            source = LazyChunkedKV(lambda: fetch_span(self.store, stored, start, end))
        job = LoadJob(request.request_id, source, start, end, slots, layers, staged)
        job.after = compute_mark(self.kv_cache.device)  # the slots' blocks may still be in use
        return job

    def _done(self, job: LoadJob) -> None:
        """The job's KV is in the pool: its read-buffer entry has served its purpose."""
        self.staged_layers_used += job.staged_layers_used
        pending = self._pending.get(job.request_id)
        if pending is not None and pending.staged is not None:
            self.read_buffer.release(pending.staged)
            pending.staged = None
        if pending is not None and pending.kv is job.saved:
            # Read and loaded: DRAM rows read in place (a lease on the tier's blocks, see
            # tiers/dram.py) are let go now, not when the request ends; a later load of the
            # same span (after a preemption) reads the store again.
            pending.kv = None

    # -- layer-wise pre-load --------------------------------------------------------------------

    def start_load(
        self, request: Request, start: int, num_tokens: int, block_table: list[int]
    ) -> None:
        """Queue the history KV of [start, start + num_tokens) to the loader thread; raises at
        once (nothing queued) when the connector holds no such KV."""
        job = self._job(request, start, num_tokens, block_table)
        self._jobs.append(job)
        self.loads_started += 1
        t0 = time.perf_counter()
        self.loader.submit(job)
        if job.inline:  # layer 0 was copied here, on the engine thread
            self.load_wait_s += time.perf_counter() - t0

    def wait_for_layer(self, layer: int) -> None:
        """Until every load started this step has written `layer` (or failed): a layer the
        loader has not begun is copied right here, one it is copying is waited for."""
        pending = [job for job in self._jobs if not job.layers[layer].is_set()]
        t0 = time.perf_counter()
        for job in pending:
            self.loader.take_layer(job, layer)
        inline = False
        for job in self._jobs:
            self.loader.take_ahead(job, layer)
            inline |= job.inline
            job.layers[layer].wait()  # CUDA: a wait_event on the compute stream, no host wait
        if pending or inline:  # the forward copied or waited
            self.load_wait_s += time.perf_counter() - t0

    def finish_loads(self) -> dict[str, Exception]:
        """Join this step's loads; {request_id: error} of those that failed."""
        jobs, self._jobs = self._jobs, []
        t0 = time.perf_counter()
        for job in jobs:
            self.loader.finish(job)
        self.load_wait_s += time.perf_counter() - t0
        for job in jobs:
            self._done(job)
        return {job.request_id: job.error for job in jobs if job.error is not None}

    # -- read buffer ----------------------------------------------------------------------------

    def set_waiting_queue(self, queue: QueueLookahead) -> None:
        self.staging.set_waiting_queue(queue)

    def look_ahead(self) -> None:
        """Stage the sessions queued next (not those of requests already admitted here)."""
        self.staging.stage_queued_sessions(self._pending)

    def stage(self, tenant: str, session_id: str) -> bool:
        """Look the session up and stage its first layers on the loader thread (a hint that it
        runs soon); False when the read buffer is off or holds it already."""
        return self.staging.stage(tenant, session_id)

    # -- during the forward -------------------------------------------------------------------

    def begin_step(self, request_ids: list[str]) -> None:
        """Name the batch's sequences (chunk order) when ForwardBatch carries no request_ids."""
        self._step_ids = list(request_ids)

    def save_layer(
        self, layer: int, k_pre_rope: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> None:
        if layer == 0 and any(n > 1 for n in batch.query_lens):
            self.idle.clear()
        elif layer == self.kv_cache.spec.num_layers - 1:
            self.idle.set()
        ids = getattr(batch, "request_ids", None) or self._step_ids
        if not ids or len(ids) != batch.num_seqs:
            return
        self.saver.save_layer(
            layer, k_pre_rope, v, batch.positions, ids, batch.query_lens, batch.context_lens
        )

    # -- after the turn -----------------------------------------------------------------------

    def request_finished(
        self, request: Request, token_ids: list[int], block_table: list[int]
    ) -> None:
        pending = self._drop(request.request_id)
        rows = self.saver.take(request.request_id)
        if self._step_ids is not None and request.request_id in self._step_ids:
            self._step_ids = None
        opened = OpenedTurn.of(request.store_turn)
        if request.session_id is None or not token_ids:
            rows.release()
            if opened is not None:
                opened.nothing_saved()
            return
        try:
            self._save_turn(request, pending, rows, token_ids, block_table)
        except BaseException:
            rows.release()
            if opened is not None:
                opened.nothing_saved()  # the API's append waits for no commit
            raise

    def forget(self, request_id: str) -> None:
        """Drop what the connector holds for a request that will never finish normally."""
        pending = self._drop(request_id)
        self.saver.drop(request_id)
        opened = OpenedTurn.of(pending.request.store_turn) if pending is not None else None
        if opened is not None:
            opened.nothing_saved()

    def _drop(self, request_id: str) -> PendingTurn | None:
        pending = self._pending.pop(request_id, None)
        if pending is not None and pending.opened is not None:
            pending.opened.unpin()  # not read (staged, or never loaded): the pins go anyway
        if pending is not None and pending.staged is not None:
            self.read_buffer.release(pending.staged)
            pending.staged = None
        return pending

    def _save_turn(
        self,
        request: Request,
        pending: PendingTurn | None,
        rows: TurnRows,
        token_ids: list[int],
        block_table: list[int],
    ) -> None:
        saved = pending.saved if pending is not None else None
        reusable = pending.reusable if pending is not None and saved is not None else 0
        self.turn_saver.save(request, saved, reusable, rows, token_ids, block_table)
