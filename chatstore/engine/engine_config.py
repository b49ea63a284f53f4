"""Limits and policies of the serving engine (scheduler, preemption, prefix caching).

max_running          sequences in the running batch at once (n>1 samples count each)
max_tokens_per_step  tokens computed per forward: decodes first, prefill chunks fill the rest
max_prefill_tokens_per_step
                     the budget of a step with no decodes in it, where no reply waits on the
                     step (at least max_tokens_per_step; None = the same): a prompt or a backlog
                     of prompts prefills in fewer, larger chunks (fewer passes over the weights
                     and the chunks before), while a step that carries decodes keeps the smaller
                     budget, so running replies do not stall behind a long prefill
finish_first_tokens  a step with no decodes in it, in which a prompt's prefill completes, takes
                     no further prompt tokens once it holds this many (0, the default here: pack
                     the whole budget; the server's Config sets 256). Prompts reaching an idle
                     engine together then get their first tokens a step apart, in arrival order,
                     not all at the end of one long step: the mean TTFT falls (the first is
                     answered after its own prefill, not the batch's) and the work is the same
admission_reserve_tokens
                     > 0: a waiting prompt is admitted beside running sequences only where the
                     pool holds all of its prompt and theirs, plus this many tokens of output
                     for each (at most what each may still generate); 0 (the default here):
                     admitted while its next chunk fits. Admitting on the next chunk alone
                     overcommits a small pool: the prompts' later chunks and the replies'
                     tokens then preempt the newest sequence, whose computed KV is dropped and
                     computed again (the server's Config sets 64)
max_waiting          requests queued before `submit` raises EngineOverloadedError (HTTP 429)
tenant_queue_share   of max_waiting one tenant may hold, at least one slot (the server's Config
                     sets 0.5; 1.0, the default here, leaves a lone tenant the whole queue)
preemption_mode      "recompute" (drop the KV, prefill again later) | "swap" (copy to host)
swap_space_bytes     host memory for swapped-out KV blocks (preemption_mode = "swap")
enable_prefix_cache  share identical full prompt blocks within a tenant (vLLM APC)
batching             "continuous" (join/leave every step) | "static" (a batch runs until its
                     longest request ends; a baseline for the benchmark)
kv_reservation       "paged" (blocks on demand) | "max" (reserve prompt + max_tokens up front,
                     the contiguous Orca-Max baseline)
split_mixed_batches  run a step's decodes and prefill chunks as two forwards, so decodes keep
                     the fast paged-decode kernel; None (default) = only when the runner cannot
                     attend a mixed batch in place (no native paged-prefill kernel): one forward
                     streams the weights once for both
cuda_graphs          decode steps through fixed buffers replayed as CUDA graphs
                     (cuda_graphs.py); None (default) = where the model runs on CUDA with
                     Triton's attention; True on a CPU runs the same path without capture
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from chatstore.config import Config

PreemptionMode = Literal["recompute", "swap"]
BatchingMode = Literal["continuous", "static"]
ReservationMode = Literal["paged", "max"]


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 32
    max_tokens_per_step: int = 512
    max_prefill_tokens_per_step: int | None = None
    finish_first_tokens: int = 0
    admission_reserve_tokens: int = 0
    max_waiting: int = 256
    tenant_queue_share: float = 1.0
    preemption_mode: PreemptionMode = "recompute"
    swap_space_bytes: int = 1 << 30
    enable_prefix_cache: bool = True
    batching: BatchingMode = "continuous"
    kv_reservation: ReservationMode = "paged"
    max_model_len: int = 0
    split_mixed_batches: bool | None = None
    cuda_graphs: bool | None = None
    idle_wait_s: float = 0.05  # how long the model thread sleeps when there is nothing to do

    def __post_init__(self) -> None:
        for name in ("max_running", "max_tokens_per_step", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        prefill = self.max_prefill_tokens_per_step
        if prefill is not None and prefill < 1:
            raise ValueError(f"max_prefill_tokens_per_step must be >= 1, got {prefill}")
        if self.admission_reserve_tokens < 0:
            raise ValueError(
                f"admission_reserve_tokens must be >= 0, got {self.admission_reserve_tokens}"
            )
        if self.finish_first_tokens < 0:
            raise ValueError(f"finish_first_tokens must be >= 0, got {self.finish_first_tokens}")
        share = self.tenant_queue_share
        if not (isinstance(share, (int, float)) and 0 < share <= 1):
            raise ValueError(f"tenant_queue_share must be in (0, 1], got {share!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be recompute|swap, got {self.preemption_mode!r}"
            )
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be continuous|static, got {self.batching!r}")
        if self.kv_reservation not in ("paged", "max"):
            raise ValueError(f"kv_reservation must be paged|max, got {self.kv_reservation!r}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")

    def step_budget(self, decoding: bool) -> int:
        """Tokens one step may compute: max_tokens_per_step when it carries decodes, else the
        larger prefill budget."""
        prefill = self.max_prefill_tokens_per_step
        if decoding or prefill is None:
            return self.max_tokens_per_step
        return max(prefill, self.max_tokens_per_step)

    @property
    def tenant_queue_limit(self) -> int:
        """Waiting slots one tenant may hold."""
        return max(1, math.ceil(self.tenant_queue_share * self.max_waiting))

    @classmethod
    def from_config(cls, config: Config) -> EngineConfig:
        """The engine fields of a `chatstore.config.Config` (keys missing there keep defaults)."""
        names = (
            "max_running",
            "max_tokens_per_step",
            "max_prefill_tokens_per_step",
            "finish_first_tokens",
            "admission_reserve_tokens",
            "max_waiting",
            "tenant_queue_share",
            "preemption_mode",
            "swap_space_bytes",
            "enable_prefix_cache",
        )
        fields = {n: getattr(config, n) for n in names if hasattr(config, n)}
        graphs = getattr(config, "cuda_graphs", "auto")
        if graphs not in _GRAPH_SETTINGS:
            raise ValueError(f"cuda_graphs must be auto|on|off, got {graphs!r}")
        return cls(**fields, cuda_graphs=_GRAPH_SETTINGS[graphs])


_GRAPH_SETTINGS: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
