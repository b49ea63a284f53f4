"""StoreConnector: the engine's KVConnector backed by the AttentionStore.

    turn n+1 prompt  [ saved history (LCP with the session's tokens) | new tokens ]
                       load(): pre-RoPE K rotated to   | prefill computes these;
                       positions 0.., V as is          | save_layer() keeps their pre-RoPE K, V
    request_finished: saved prefix + computed rows (+ device blocks un-rotated for any gap)
                      -> one SessionKV, committed to the store as a whole turn

Async save: on the engine thread `request_finished` only copies what lives in the device pool
(rows the connector never saw computed, usually none); assembling the SessionKV and writing it
to the tiers is handed to the store's writer thread (`AttentionStore.save_later`) when the
store runs with `async_save`.

Layer-wise pre-load (CachedAttention §3.2.1, without the HBM read buffer): instead of `load`
(all layers, synchronously, before the prefill) the engine may call `start_load` for each of the
step's loads; a loader thread writes the history KV layer 0, 1, ..., L-1 and sets a per-layer
event after each, while the forward runs. The runner calls `wait_for_layer(i)` right before layer
i's attention reads the pool, so the copy of layer i+1.. overlaps the compute of layer i. After
the forward the engine calls `finish_loads()` (joins, returns per-request errors). Not done:
the read buffer (starting the next job's pre-load while the current job runs) and the larger
pre-load buffer of Fig. 7(b); a load starts when its step starts.

What the engine must give: `num_external_tokens` is called (once or more) for every new request
before `load`; in `save_layer`, the batch's rows must be attributable to requests, either by a
`request_ids: list[str]` attribute on ForwardBatch (one per sequence, in chunk order) or by
calling `begin_step(request_ids)` before each forward. Rows of ids the connector does not know
(no session, or extra samples of n > 1) are ignored.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from chatstore.engine.forward_batch import ForwardBatch
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.request import Request
from chatstore.engine.rope import RotaryEmbedding
from chatstore.store.attention_store import AttentionStore
from chatstore.store.decoupled import rope_at, unrope
from chatstore.store.session_kv import SessionKV, common_prefix_len
from chatstore.store.writer import _own_torch_threads

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: Request
    saved: SessionKV | None
    reusable: int  # leading prompt tokens the saved KV covers (LCP)
    rows: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )  # layer -> [(positions [t], k_pre [t, H, D], v [t, H, D])]


@dataclass
class _LoadJob:
    request_id: str
    saved: SessionKV
    start: int
    end: int
    slots: torch.Tensor  # flat pool slots of positions [start, end), on the pool's device
    layers: list[threading.Event]  # layer i's history KV is in the pool (or the load failed)
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


class StoreConnector:
    def __init__(
        self,
        store: AttentionStore,
        kv_cache: PagedKVCache,
        rope: RotaryEmbedding,
        layer_delay_s: float = 0.0,
        loader_threads: int | None = 1,
    ):
        self.store = store
        self.kv_cache = kv_cache
        self.rope = rope
        self._pending: dict[str, _Pending] = {}
        self._step_ids: list[str] | None = None
        # Layer-wise pre-load. layer_delay_s: an extra sleep per layer copied (per load),
        # simulating a slower tier (tests, bench/preload.py). loader_threads: torch intra-op
        # threads of the loader thread (1: it does not fight the forward for the cores).
        self.layer_delay_s = layer_delay_s
        self.loader_threads = loader_threads
        self._jobs: list[_LoadJob] = []  # loads started this step
        self._queue: queue.SimpleQueue[_LoadJob] = queue.SimpleQueue()
        self._loader: threading.Thread | None = None
        self.loads_started = 0
        self.load_wait_s = 0.0  # cumulative time wait_for_layer blocked the forward
        self.load_copy_s = 0.0  # cumulative time the loader spent copying (delays included)

    # -- before the prefill -------------------------------------------------------------------

    def num_external_tokens(self, request: Request, num_computed: int) -> int:
        pending = self._pending.get(request.request_id) or self._start(request)
        return max(0, pending.reusable - num_computed)

    def _start(self, request: Request) -> _Pending:
        saved = None
        if request.session_id is not None:
            saved = self.store.lookup(request.tenant, request.session_id)
        reusable = 0
        if saved is not None:
            # Keep at least one prompt token to compute: its logits give the first new token.
            lcp = common_prefix_len(saved.token_ids, request.prompt_token_ids)
            reusable = min(lcp, len(request.prompt_token_ids) - 1)
        pending = _Pending(request, saved, reusable)
        self._pending[request.request_id] = pending
        return pending

    def load(self, request: Request, start: int, num_tokens: int, block_table: list[int]) -> None:
        """Synchronous: every layer's history KV is in the pool when this returns."""
        job = self._job(request, start, num_tokens, block_table)
        for layer in range(self.kv_cache.spec.num_layers):
            self._copy_layer(job, layer)

    def _job(
        self, request: Request, start: int, num_tokens: int, block_table: list[int]
    ) -> _LoadJob:
        pending = self._pending.get(request.request_id)
        end = start + num_tokens
        if pending is None or pending.saved is None or end > pending.reusable:
            raise RuntimeError(f"request {request.request_id}: no saved KV for [{start}, {end})")
        positions = torch.arange(start, end)
        slots = _slots(block_table, positions, self.kv_cache.block_size).to(self.kv_cache.device)
        layers = [threading.Event() for _ in range(self.kv_cache.spec.num_layers)]
        return _LoadJob(request.request_id, pending.saved, start, end, slots, layers)

    def _copy_layer(self, job: _LoadJob, layer: int) -> None:
        dev = self.kv_cache.device
        k = job.saved.k(layer)[job.start : job.end].to(dev)
        v = job.saved.v(layer)[job.start : job.end].to(dev)
        positions = torch.arange(job.start, job.end, device=dev)
        k = rope_at(k, positions, self.rope, self.kv_cache.dtype)
        self.kv_cache.write(layer, k, v, job.slots)
        if self.layer_delay_s > 0:
            time.sleep(self.layer_delay_s)

    # -- layer-wise pre-load --------------------------------------------------------------------

    def start_load(
        self, request: Request, start: int, num_tokens: int, block_table: list[int]
    ) -> None:
        """Queue the history KV of [start, start + num_tokens) to the loader thread; raises at
        once (nothing queued) when the connector holds no such KV."""
        job = self._job(request, start, num_tokens, block_table)
        self._jobs.append(job)
        self.loads_started += 1
        if self._loader is None or not self._loader.is_alive():
            self._loader = threading.Thread(
                target=self._load_loop, name="chatstore-loader", daemon=True
            )
            self._loader.start()
        self._queue.put(job)

    def wait_for_layer(self, layer: int) -> None:
        """Block until every load started this step has written `layer` (or failed)."""
        pending = [job.layers[layer] for job in self._jobs if not job.layers[layer].is_set()]
        if not pending:
            return
        t0 = time.perf_counter()
        for event in pending:
            event.wait()
        self.load_wait_s += time.perf_counter() - t0

    def finish_loads(self) -> dict[str, Exception]:
        """Join this step's loads; {request_id: error} of those that failed."""
        jobs, self._jobs = self._jobs, []
        t0 = time.perf_counter()
        for job in jobs:
            job.done.wait()
        self.load_wait_s += time.perf_counter() - t0
        return {job.request_id: job.error for job in jobs if job.error is not None}

    def _load_loop(self) -> None:
        if self.loader_threads:
            _own_torch_threads(self.loader_threads)
        stream = None
        if torch.device(self.kv_cache.device).type == "cuda":
            stream = torch.cuda.Stream(device=self.kv_cache.device)
        while True:
            jobs = [self._queue.get()]
            while True:  # loads queued together are copied layer-major, side by side
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    for layer in range(self.kv_cache.spec.num_layers):
                        for job in jobs:
                            self._load_layer(job, layer, stream)
            finally:
                for job in jobs:  # never leave the forward waiting
                    for event in job.layers:
                        event.set()
                    job.done.set()
                self.load_copy_s += time.perf_counter() - t0

    def _load_layer(self, job: _LoadJob, layer: int, stream) -> None:
        if job.error is None:
            try:
                if stream is None:
                    self._copy_layer(job, layer)
                else:
                    with torch.cuda.stream(stream):
                        self._copy_layer(job, layer)
                    stream.synchronize()  # the event means: readable by the forward's stream
            except Exception as exc:
                log.exception("KV pre-load of %s failed at layer %d", job.request_id, layer)
                job.error = exc
        job.layers[layer].set()

    # -- during the forward -------------------------------------------------------------------

    def begin_step(self, request_ids: list[str]) -> None:
        """Name the batch's sequences (chunk order) when ForwardBatch carries no request_ids."""
        self._step_ids = list(request_ids)

    def save_layer(
        self, layer: int, k_pre_rope: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> None:
        ids = getattr(batch, "request_ids", None) or self._step_ids
        if not ids or len(ids) != batch.num_seqs:
            return
        dtype = self.store.settings.storage_dtype
        row = 0
        for rid, n in zip(ids, batch.query_lens, strict=True):
            pending = self._pending.get(rid)
            if pending is not None and pending.request.session_id is not None:
                pending.rows.setdefault(layer, []).append(
                    (
                        batch.positions[row : row + n].cpu(),
                        k_pre_rope[row : row + n].to("cpu", dtype, copy=True),
                        v[row : row + n].to("cpu", dtype, copy=True),
                    )
                )
            row += n

    # -- after the turn -----------------------------------------------------------------------

    def request_finished(
        self, request: Request, token_ids: list[int], block_table: list[int]
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if self._step_ids is not None and request.request_id in self._step_ids:
            self._step_ids = None
        if request.session_id is None or not token_ids:
            return
        n, build = self._assembler(pending, token_ids, block_table)
        if n > 0:
            nbytes = n * self.store.layout.bytes_per_token
            self.store.save_later(request.tenant, request.session_id, build, nbytes)

    def forget(self, request_id: str) -> None:
        """Drop what the connector holds for a request that will never finish normally."""
        self._pending.pop(request_id, None)

    def _assemble(
        self, pending: _Pending | None, token_ids: list[int], block_table: list[int]
    ) -> SessionKV:
        return self._assembler(pending, token_ids, block_table)[1]()

    def _assembler(
        self, pending: _Pending | None, token_ids: list[int], block_table: list[int]
    ) -> tuple[int, Callable[[], SessionKV]]:
        """(tokens to save, a builder of their SessionKV). What the device pool alone holds is
        copied now (its blocks are freed after request_finished); the builder touches only
        CPU tensors it owns, so it may run on another thread."""
        spec, B = self.kv_cache.spec, self.kv_cache.block_size
        n = min(len(token_ids), len(block_table) * B)
        rows = pending.rows if pending is not None else {}
        if rows.get(0):
            # The last sampled token is never fed back: its KV does not exist.
            n = min(n, 1 + max(int(p.max()) for p, _, _ in rows[0]))
        saved = pending.saved if pending is not None else None
        m = min(pending.reusable, n) if pending is not None and saved is not None else 0
        have = torch.zeros(n, dtype=torch.bool)
        have[:m] = True
        for p, _, _ in rows.get(0, []):
            have[p[p < n]] = True
        missing = (~have).nonzero().flatten()
        device_rows = self._copy_from_device(missing, block_table) if len(missing) else None
        ids = list(token_ids[:n])
        dtype = self.store.settings.storage_dtype

        def build() -> SessionKV:
            shape = (spec.num_layers, 2, n, spec.num_kv_heads, spec.head_dim)
            kv = torch.empty(shape, dtype=dtype)
            if saved is not None and m:
                kv[:, :, :m] = saved.kv[:, :, :m]
            for layer, chunks in rows.items():
                pos = torch.cat([p for p, _, _ in chunks])
                keep = pos < n
                kv[layer, 0, pos[keep]] = torch.cat([k for _, k, _ in chunks])[keep].to(dtype)
                kv[layer, 1, pos[keep]] = torch.cat([v for _, _, v in chunks])[keep].to(dtype)
            if device_rows is not None:
                kv[:, :, missing] = device_rows.to(dtype)
            return SessionKV(ids, kv)

        return n, build

    def _copy_from_device(self, positions: torch.Tensor, block_table: list[int]) -> torch.Tensor:
        """Tokens the connector never saw computed (device prefix cache): un-rotated pool K and
        V, [L, 2, len(positions), Hkv, D] on the CPU."""
        cache = self.kv_cache
        slots = _slots(block_table, positions, cache.block_size).to(cache.device)
        flat = (cache.num_blocks * cache.block_size, cache.spec.num_kv_heads, cache.spec.head_dim)
        dev_positions = positions.to(cache.device)
        out = torch.empty(
            (cache.spec.num_layers, 2, len(positions), *flat[1:]),
            dtype=self.store.settings.storage_dtype,
        )
        for layer in range(cache.spec.num_layers):
            k = cache.k(layer).reshape(flat).index_select(0, slots)
            v = cache.v(layer).reshape(flat).index_select(0, slots)
            out[layer, 0] = unrope(k, dev_positions, self.rope).to("cpu", out.dtype)
            out[layer, 1] = v.to("cpu", out.dtype)
        return out


def _slots(block_table: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def create_connector(store: AttentionStore | None, kv_cache: PagedKVCache, rope: RotaryEmbedding):
    """StoreConnector over `store`, or the recompute baseline (NullConnector) when it is None."""
    from chatstore.engine.kv_connector import NullConnector

    return NullConnector() if store is None else StoreConnector(store, kv_cache, rope)
