"""The read stream of layer-wise pre-load (CachedAttention §3.2.1): one loader thread that writes
history KV into the device pool layer by layer while the forward runs, and fills the read
buffer for the jobs queued next when it has nothing else to do; one lookup thread that reads
the hinted sessions' KV out of the store for it.

    engine thread                          loader thread
    submit(job) x loads of this step  ──►  layer 0 of every job, layer 1, ..., L-1
    forward: layer i waits job.layers[i],  (per layer: read buffer copy, or tier copy
                                            [+ int8 dequantise] + RoPE)
      or copies it itself if the loader has not started it (take_layer: one claim per layer);
      on a CPU host staged layers are left to the forward (_left_to_forward)
    finish(job): the layers nobody         idle: stage layers 0..N-1 rotated of a looked-up
      took yet are copied right here         entry, pausing between layers whenever a load
                                             arrives
    stage(entry) ──► lookup thread: find + read the session (any tier; may be slow) ->
                     ReadBuffer.publish -> the loader stages its layers

The engine thread waits only for a layer copy another thread is doing: never for a lookup (a
client's hint may name a session whose KV sits in a slow or unreachable tier), nor for the
loader to get round to a job (`finish` copies what is left itself). Loads always come first:
staging checks for them between layers. On CUDA the copies run on a stream of the loader's own,
ordered by events, never by a host wait (copy_events.py): a load's copies start after an event
recorded on the compute stream when it was submitted, each layer records an event once its copy
is issued, and the forward's stream waits on it (`wait_event`); on a CPU host the layer's
threading.Event is set once the copy has finished, and the threads run torch with `threads`
intra-op threads (1: no OpenMP team as wide as the forward's on the same cores).

What a layer copy reads on the host (layer_copy.py): DRAM rows in place from the tier's pinned
pool, anything else through a pinned staging ring (pinned_staging.py; made here on CUDA, none
on a CPU, where a "copy to the device" is the host tensor itself). A ring slot is retired with
a fence recorded after the layer's work, and the stored rows (which hold the DRAM blocks'
leases) are kept until that fence is done (`_kept`), so no host memory a copy still reads is
reused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from chatstore.cpu_threads import own_intra_op_threads
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.rope import RotaryEmbedding, apply_rope
from chatstore.store.session_kv import SessionKey
from chatstore.transfer.chunked_kv import ChunkedKV, LazyChunkedKV, MissingChunkError
from chatstore.transfer.copy_events import LayerDone, keep_for, order_after
from chatstore.transfer.layer_copy import LayerCopier
from chatstore.transfer.pinned_staging import StagingRing
from chatstore.transfer.read_buffer import ReadBuffer, StagedKV

log = logging.getLogger(__name__)


@dataclass
class LoadJob:
    """Write the saved history KV of positions [start, end) into `slots` of the pool."""

    request_id: str
    saved: ChunkedKV | LazyChunkedKV  # the stored chunks covering [start, end)
    start: int
    end: int
    slots: torch.Tensor  # flat pool slots of positions [start, end), on the pool's device
    layers: list[LayerDone]  # layer i's history KV is in the pool (or the load failed)
    staged: StagedKV | None = None  # read-buffer entry: its layers need no RoPE, no tier read
    after: torch.cuda.Event | None = None  # CUDA: compute-stream event the copies come after
    inline: bool = False  # the forward takes every layer itself (LayerLoader.inline)
    error: Exception | None = None
    claims: list[threading.Lock] = field(default_factory=list)  # who copies layer i
    from_buffer: list[bool] = field(default_factory=list)
    _cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.claims = [threading.Lock() for _ in self.layers]
        self.from_buffer = [False] * len(self.layers)

    @property
    def staged_layers_used(self) -> int:
        return sum(self.from_buffer)


class LayerLoader:
    def __init__(
        self,
        kv_cache: PagedKVCache,
        rope: RotaryEmbedding,
        lookup: Callable[[SessionKey], ChunkedKV | None],
        buffer: ReadBuffer,
        layer_delay_s: float = 0.0,
        threads: int | None = 1,
        staging: StagingRing | None = None,
        inline: bool | None = None,
    ) -> None:
        """staging: the ring non-DRAM rows cross through (None: one of the default size on
        CUDA, none on a CPU). inline: loads whose rows are already read are copied by the
        forward itself, each layer's copy issued one layer ahead of its compute, not by the
        loader thread (None: on CUDA). There the copies are asynchronous on the copy stream,
        so a thread has no I/O to hide and contends with the forward for the GIL. Measured on
        an H200 (100 tokens on a 4K history, docs/gpu.md), inline against the thread: 25.2 vs
        45.0 ms and 29.3 vs 29.6 ms (135M shape), 15.8 vs 15.1 ms (1B shape); both stay
        slower than loading first (20-24 and 11.5 ms)."""
        self.kv_cache = kv_cache
        self.rope = rope
        self.lookup = lookup
        self.buffer = buffer
        # An extra sleep per layer read from the store (not from the read buffer): a tier slower
        # than DRAM, for tests and bench/preload.py.
        self.layer_delay_s = layer_delay_s
        self.threads = threads
        self._loads: deque[LoadJob] = deque()
        self._stages: deque[StagedKV] = deque()  # looked up, layers to stage
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._lookups: deque[StagedKV] = deque()
        self._lookup_cond = threading.Condition()
        self._lookup_thread: threading.Thread | None = None
        self._closed = False  # close(): both threads leave their loops
        cuda = kv_cache.device.type == "cuda"
        self.inline = cuda if inline is None else inline
        # The copy stream, made here: inline copies are issued by the engine thread.
        self._stream = torch.cuda.Stream(device=kv_cache.device) if cuda else None
        if staging is None and cuda:
            staging = StagingRing()
        self.copier = LayerCopier(kv_cache.device, kv_cache.dtype, staging)
        self.copy_s = 0.0  # time spent writing loads into the pool (delays included)
        self.stage_s = 0.0  # time spent staging (lookups included)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loader and lookup threads once the engine has stopped (no load is in
        flight): they hold the pool, the store and, through them, the whole engine."""
        for cond in (self._cond, self._lookup_cond):
            with cond:
                self._closed = True
                cond.notify_all()
        for thread in (self._thread, self._lookup_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)

    # -- engine thread -----------------------------------------------------------------------

    def submit(self, job: LoadJob) -> None:
        if self.inline and not isinstance(job.saved, LazyChunkedKV):
            # Rows in host memory already (no tier read left for a thread to hide): layer 0's
            # copy now, the rest from the forward's waits (take_ahead).
            job.inline = True
            self.take_layer(job, 0)
            return
        with self._cond:
            self._loads.append(job)
            self._ensure_thread()
            self._cond.notify_all()

    def stage(self, entry: StagedKV) -> None:
        """Look the entry up (lookup thread), then stage its layers (loader thread)."""
        with self._lookup_cond:
            self._lookups.append(entry)
            if self._lookup_thread is None:
                self._lookup_thread = threading.Thread(
                    target=self._run_lookups, name="chatstore-stage-lookup", daemon=True
                )
                self._lookup_thread.start()
            self._lookup_cond.notify_all()

    def take_layer(self, job: LoadJob, layer: int) -> bool:
        """Copy layer `layer` of the job now, on the calling thread, unless another thread has
        taken it (then False: wait for `job.layers[layer]`). The forward takes a layer the
        loader has not reached rather than wait for the loader to be scheduled: on a CPU host
        the loader shares the cores with the forward's own threads."""
        if not job.claims[layer].acquire(blocking=False):
            return False
        self._on_stream(lambda: self._copy_or_fail(job, layer), job)
        return True

    def take_ahead(self, job: LoadJob, layer: int) -> None:
        """The forward reached `layer`: an inline job's next layer is copied now, so its copy
        runs on the copy stream while `layer` computes."""
        if job.inline and layer + 1 < len(job.layers):
            self.take_layer(job, layer + 1)

    def _copy_or_fail(self, job: LoadJob, layer: int) -> None:
        """Copy the layer (on the copy stream, when there is one), then mark it done there."""
        try:
            if job.error is None:
                self.copy_layer(job, layer)
        except Exception as exc:
            log.exception("KV pre-load of %s failed at layer %d", job.request_id, layer)
            job.error = exc
        finally:
            job.layers[layer].set()

    def copy_layer(self, job: LoadJob, layer: int) -> None:
        """Layer `layer` of the job into the pool, on the calling thread."""
        staged = job.staged
        if staged is not None and layer < staged.num_staged_layers:
            k = staged.k[layer][job.start : job.end]
            v = staged.v[layer][job.start : job.end]
            self.kv_cache.write(layer, k, v, job.slots)
            job.from_buffer[layer] = True
            return
        dev = self.kv_cache.device
        if job._cos_sin is None:  # once per job, not per layer
            positions = torch.arange(job.start, job.end, device=dev)
            cos, sin = self.rope.cos_sin(positions, self.kv_cache.dtype)
            job._cos_sin = (cos, sin)
        cos, sin = job._cos_sin
        saved = job.saved.get() if isinstance(job.saved, LazyChunkedKV) else job.saved
        rows = self.copier.rows(saved, layer, job.start, job.end, self._may_wait())
        self.kv_cache.write(layer, apply_rope(rows.k, cos, sin), rows.v, job.slots)
        self.copier.done(rows, saved)
        if self.layer_delay_s > 0:
            time.sleep(self.layer_delay_s)

    # -- loader thread -----------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="chatstore-loader", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        if self.threads:
            own_intra_op_threads(self.threads)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._loads or self._stages or self._closed)
                if self._closed:
                    return
                entry = None if self._loads else self._stages.popleft()
            if entry is None:
                self._serve_loads()
            else:
                t0 = time.perf_counter()
                try:
                    with torch.no_grad():
                        self._stage_layers(entry)
                except Exception:
                    log.exception("read-buffer staging of %s failed", entry.key)
                    self.buffer.discard(entry.key)
                finally:
                    self.stage_s += time.perf_counter() - t0

    def _serve_loads(self) -> None:
        """Every queued load, layer-major (side by side, so layer 0 of each is done first)."""
        with self._cond:
            jobs = list(self._loads)
            self._loads.clear()
        if not jobs:
            return
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                for layer in range(self.kv_cache.spec.num_layers):
                    for job in jobs:
                        if not self._left_to_forward(job, layer):
                            self.take_layer(job, layer)
        finally:
            self.copy_s += time.perf_counter() - t0

    def _left_to_forward(self, job: LoadJob, layer: int) -> bool:
        """A staged layer on a CPU host is a plain copy of a few hundred microseconds: the
        forward takes it just in time on its own threads (measured 4 ms for 30 layers of a 1K
        history), cheaper than a loader thread copying beside the forward on the same cores.
        With a GPU the loader's stream does it, in parallel with compute."""
        staged = job.staged
        return self._stream is None and staged is not None and layer < staged.num_staged_layers

    def finish(self, job: LoadJob) -> None:
        """After the forward: every layer is in the pool when this returns. A layer nobody
        has taken (the forward never reached it, or the loader is busy) is copied here; the
        loader, when it gets to the job, finds every layer claimed and copies nothing."""
        for layer, event in enumerate(job.layers):
            if not event.is_set():
                self.take_layer(job, layer)
            event.wait()  # CUDA: the compute stream waits for the copy; CPU: it has finished

    # -- lookup thread -----------------------------------------------------------------------

    def _run_lookups(self) -> None:
        if self.threads:
            own_intra_op_threads(self.threads)
        while True:
            with self._lookup_cond:
                self._lookup_cond.wait_for(lambda: bool(self._lookups) or self._closed)
                if self._closed:
                    return
                entry = self._lookups.popleft()
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    self._look_up(entry)
            except MissingChunkError as exc:  # gone, or out of reach: nothing to stage
                log.debug("read-buffer lookup of %s: %s", entry.key, exc)
                self.buffer.publish(entry, None, 0)
            except Exception:
                log.exception("read-buffer lookup of %s failed", entry.key)
                self.buffer.publish(entry, None, 0)  # dropped: a claim reads the store itself
            finally:
                self.stage_s += time.perf_counter() - t0

    def _look_up(self, entry: StagedKV) -> None:
        """Read the entry's session and publish it, counted with the layers to stage; those
        are then staged by the loader thread."""
        if not self.buffer.begin(entry):
            return
        saved = self.lookup(entry.key)
        layers = self._layers_to_stage(saved)
        if not self.buffer.publish(entry, saved, self._staged_bytes(saved, layers)) or not layers:
            return
        with self._cond:
            self._stages.append(entry)
            self._ensure_thread()
            self._cond.notify_all()

    def _layers_to_stage(self, saved: ChunkedKV | None) -> int:
        if saved is None or saved.num_tokens == 0:
            return 0
        return min(self.buffer.layers, self.kv_cache.spec.num_layers)

    def _staged_bytes(self, saved: ChunkedKV | None, layers: int) -> int:
        """The saved copy plus `layers` rotated K and V in the pool's dtype."""
        if saved is None:
            return 0
        spec = self.kv_cache.spec
        per_token = spec.num_kv_heads * spec.head_dim * self.kv_cache.kv.element_size()
        return saved.nbytes + layers * 2 * saved.num_tokens * per_token

    # -- loader thread: staging --------------------------------------------------------------

    def _stage_layers(self, entry: StagedKV) -> None:
        saved = entry.saved
        layers = self._layers_to_stage(saved)
        if saved is None or entry.cancelled:
            return
        dev, dtype = self.kv_cache.device, self.kv_cache.dtype
        cos, sin = self.rope.cos_sin(torch.arange(saved.num_tokens, device=dev), dtype)
        for layer in range(layers):
            self._serve_loads()  # the running step's loads go first
            if entry.cancelled:
                return

            def stage_layer(layer: int = layer, saved: ChunkedKV = saved) -> None:
                rows = self.copier.rows(saved, layer, saved.start, saved.end, self._may_wait())
                k = apply_rope(rows.k, cos, sin)
                v = rows.v  # CPU, same dtype: a view, no copy
                if v.device.type == "cpu" and (rows.slot is not None or rows.pooled_runs):
                    v = v.clone()  # kept past this copy: not a view of a slot or the pool
                self.copier.done(rows, saved)
                if self.layer_delay_s > 0:
                    time.sleep(self.layer_delay_s)
                entry.k.append(k)
                entry.v.append(v)

            self._on_stream(stage_layer)

    def _may_wait(self) -> bool:
        """Only the loader's own thread may wait for staging-ring space; the engine thread,
        taking a layer, copies plainly instead."""
        return threading.current_thread() is self._thread

    def _on_stream(self, fn: Callable[[], None], job: LoadJob | None = None) -> None:
        """fn on the copy stream (CUDA), after the compute the
        job was submitted behind; its pool slots, made on the compute stream, live until the
        copy stream is done with them. Staged layers need no wait either: only copy_layer
        reads them, on this same stream."""
        stream = self._stream
        if stream is None:
            fn()
            return
        with torch.cuda.stream(stream):
            if job is not None:
                order_after(stream, job.after)
                keep_for(stream, job.slots)
            fn()
