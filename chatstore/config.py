"""Configuration: defaults from config/default.toml, then CHATSTORE_* env, then CLI flags."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

# The CPU's flags are read in one place (kernels/native.py); `_cpu_flags` is the name tests replace.
from chatstore.kernels.native import cpu_flags as _cpu_flags
from chatstore.kernels.native import flags_of

DEFAULT_CONFIG_FILE = Path(__file__).resolve().parent.parent / "config" / "default.toml"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
# The store may also keep KV as int8 with a scale per token and head (chatstore/store/kv_quant.py).
KV_STORAGE_CHOICES = (*DTYPE_CHOICES, "int8")
# Weights the projections compute with (chatstore/engine/weight_plan.py); bf16 / fp32 name the
# dense weights' dtype, which the compute dtype follows under dtype = auto.
WEIGHTS_CHOICES = ("auto", "bf16", "fp32", "int8", "int4")
# What a quantized projection's prefill multiplies (weight_plan.py): its weight expanded just in
# time, or a 16-bit copy kept resident; auto keeps copies while they fit a budget.
PREFILL_WEIGHTS_CHOICES = ("auto", "expand", "copy")
_DENSE_WEIGHTS = {"bf16": "bfloat16", "fp32": "float32"}
# CPU features with native bf16 arithmetic. Without them oneDNN emulates bf16 through fp32 and
# a bf16 GEMM runs ~5x slower than fp32 (measured on an AVX512 Xeon without AVX512-BF16).
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): from `cpuinfo` (the text
    of /proc/cpuinfo), or this machine's, read once."""
    flags = _cpu_flags() if cpuinfo is None else flags_of(cpuinfo)
    return any(f in flags for f in _BF16_CPU_FLAGS)


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """The compute dtype `name` stands for: "auto" is bf16 where bf16 is fast, else float32."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {name!r}")
        return name
    if device.startswith("cuda"):
        fast = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    else:
        fast = cpu_has_fast_bf16()
    return "bfloat16" if fast else "float32"


@dataclass
class Config:
    model: str = "default"
    dtype: str = "auto"
    weights: str = "auto"  # auto | bf16 | fp32 | int8 | int4 (see WEIGHTS_CHOICES)
    prefill_weights: str = "auto"  # auto | expand | copy (see PREFILL_WEIGHTS_CHOICES)
    device: str = "cpu"
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30
    attention: str = "auto"
    max_running: int = 32  # serving engine limits: see chatstore/engine/engine_config.py
    max_tokens_per_step: int = 512
    max_prefill_tokens_per_step: int = 2048  # a step without decodes (vLLM's CPU default)
    finish_first_tokens: int = 256  # a step that finishes a prompt stops taking others here
    admission_reserve_tokens: int = 64  # admit only where every prompt and this much output fit
    max_waiting: int = 256
    tenant_queue_share: float = 0.5  # of max_waiting one tenant may hold (at least one slot)
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 1 << 30
    enable_prefix_cache: bool = True
    kv_layout: str = "paged"  # paged | vattention (chatstore/engine/vattention/)
    kv_page_size: int = 4096  # vattention: bytes committed at a time (4096, or 2097152 huge)
    kv_reclaim_watermark_bytes: int = -1  # vattention: idle slots' pages kept (-1 = budget/4)
    cuda_graphs: str = "auto"  # decode as CUDA graphs: auto (on CUDA) | on | off
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: str = ""  # "key1:tenant1,key2:tenant2"; "" (and no admin_key) = local mode
    admin_key: str = ""
    api_keys_file: str = ""  # hashed keys (`chatstore keys`); "" = <data_dir>/api_keys.json
    max_body_bytes: int = 1 << 20
    max_message_chars: int = 32768
    max_messages: int = 512  # per request and per stored session
    max_metadata_bytes: int = 16384  # a session's metadata, as JSON
    max_sessions_per_tenant: int = 10000
    max_turns_per_tenant: int = 0  # turns in flight per tenant; 0 = 16 with keys, none in local
    allowed_hosts: str = ""  # local mode: Host names accepted besides loopback ones
    cors_origins: str = ""  # "*" or "https://a,https://b": origins allowed cross-origin
    metrics_auth: bool = False  # with keys set: /metrics needs the admin key
    log_level: str = "info"
    data_dir: str = ""
    kv_store: str = "on"
    dram_bytes: int = 4 << 30
    ssd_bytes: int = 32 << 30
    redis_url: str = ""
    records_url: str = ""  # records' home: "" = redis_url's Redis (else LMDB), "lmdb", a Redis URL
    redis_bytes: int = 4 << 30  # the shared tier's planned size (reported); Redis evicts, not us
    redis_cluster: bool = False  # redis_url names a Redis Cluster (or use redis+cluster://)
    redis_timeout_s: float = 0.25  # socket timeout of every Redis call
    redis_tls_ca_file: str = ""  # rediss://: CA of Redis's certificate ("" = the system's CAs)
    redis_tls_cert_file: str = ""  # client certificate (Redis with tls-auth-clients yes)
    redis_tls_key_file: str = ""  # its private key
    redis_tls_check_hostname: bool = True  # Redis's certificate must name the URL's host
    redis_username: str = ""  # ACL user (AUTH user password); wins over the URL's user
    redis_password: str = ""  # better set as CHATSTORE_REDIS_PASSWORD than in a file
    session_lease_s: float = 30.0  # a turn's lease on its session in Redis (renewed while it runs)
    replica_id: str = ""  # this server's name in leases and KV events ("" = host:port:pid)
    kv_events_endpoint: str = ""  # ZMQ PUB endpoint for KV cache events, e.g. tcp://*:5557
    kv_events_replay_endpoint: str = ""  # ZMQ ROUTER endpoint replaying buffered events
    kv_events_topic: str = ""  # topic frame of every batch ("" = kv@<pod>@<model>, llm-d's form)
    kv_events_pod: str = ""  # <pod> in that topic ("" = $POD_IP:port, $POD_NAME or host name)
    redis_breaker_failures: int = 3  # consecutive failures that take Redis out
    redis_breaker_reset_s: float = 5.0  # then one probe after this long puts it back
    kv_storage_dtype: str = "auto"  # "auto" = the compute dtype; int8: half of bf16's bytes
    session_ttl_s: int = 86400
    purge_interval_s: float = 60.0  # how often expired sessions are deleted (0 = never)
    records_map_bytes: int = 1 << 30  # LMDB map of the session records
    max_context_tokens: int = 8192
    truncation_ratio: float = 0.5
    policy: str = "aware"  # aware | lru | fifo: which session a full tier gives up
    prefetch_interval_s: float = 0.05  # scheduler-aware fetch: how often the queue is scanned
    async_save: bool = True  # a finished turn's KV is written by a background thread
    background_restore: bool = True  # the session index is read from the records after start
    write_buffer_bytes: int = 1 << 30  # turns waiting for that thread; full = engine waits
    read_buffer_layers: int = -1  # layers of queued/hinted sessions staged ahead (-1 all, 0 off)
    read_buffer_bytes: int = 512 << 20  # what the read buffer may hold
    read_buffer_queue: str = "auto"  # stage queued sessions too: on | off | auto (GPU only)
    chunk_tokens: int = 256  # tokens per stored KV chunk (a multiple of block_size)
    persist: str = "write_back"  # completed chunks reach LMDB: write_back | write_through | off
    persist_lag_s: float = 2.0  # write_back: at most this long after a chunk is stored
    encrypt_at_rest: bool = True  # seal records and KV in LMDB / Redis (AES-256-GCM per tenant)
    secret_key: str = ""  # master key "id:base64,..." (CHATSTORE_SECRET_KEY); the first wraps
    secret_key_file: str = ""  # "id:base64" per line, 0600 ("" = ~/.config/chatstore/secret.key)

    @property
    def resolved_dtype(self) -> str:
        """The compute dtype this config runs in ("auto" resolved for this machine, or the
        dtype `weights = bf16 | fp32` names)."""
        if self.dtype == "auto" and self.weights in _DENSE_WEIGHTS:
            return _DENSE_WEIGHTS[self.weights]
        return resolve_dtype(self.dtype, self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved_dtype]

    @property
    def storage_torch_dtype(self) -> torch.dtype:
        """The dtype the store keeps KV in: the compute dtype unless set otherwise."""
        if self.kv_storage_dtype == "auto":
            return self.torch_dtype
        if self.kv_storage_dtype == "int8":
            return torch.int8
        return DTYPES[self.kv_storage_dtype]

    def for_model_dtype(self, model_dtype: torch.dtype) -> Config:
        """This config as it runs a model already loaded in `model_dtype`.

        `dtype = "auto"` follows the model (a model loaded in fp32 runs, and its KV is stored,
        in fp32 whatever this CPU would pick), so a caller that loads the model itself never
        gets a KV pool or store in another dtype than its weights. An explicit dtype that
        differs from the model's is an error naming both."""
        name = str(model_dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"the model is loaded in {name}; supported: {list(DTYPES)}")
        if self.dtype == "auto":
            return self if self.resolved_dtype == name else replace(self, dtype=name)
        if self.dtype != name:
            raise ValueError(f"dtype = {self.dtype!r} but the model given is loaded in {name}")
        return self

    def validate(self) -> Config:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.weights not in WEIGHTS_CHOICES:
            raise ValueError(
                f"weights must be one of {list(WEIGHTS_CHOICES)}, got {self.weights!r}"
            )
        if self.prefill_weights not in PREFILL_WEIGHTS_CHOICES:
            raise ValueError(
                f"prefill_weights must be one of {list(PREFILL_WEIGHTS_CHOICES)}, "
                f"got {self.prefill_weights!r}"
            )
        dense = _DENSE_WEIGHTS.get(self.weights)
        if dense is not None and self.dtype not in ("auto", dense):
            raise ValueError(f"weights = {self.weights} needs dtype = {dense} (or auto)")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.kv_layout not in ("paged", "vattention"):
            raise ValueError(f"kv_layout must be paged|vattention, got {self.kv_layout!r}")
        if self.kv_page_size not in (4096, 2 << 20):
            raise ValueError(f"kv_page_size must be 4096 or 2097152, got {self.kv_page_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        self._validate_store()
        return self

    def _validate_store(self) -> None:
        if self.kv_store not in ("on", "off"):
            raise ValueError(f"kv_store must be 'on' or 'off', got {self.kv_store!r}")
        if self.kv_storage_dtype not in KV_STORAGE_CHOICES:
            raise ValueError(
                f"kv_storage_dtype must be one of {list(KV_STORAGE_CHOICES)}, "
                f"got {self.kv_storage_dtype!r}"
            )
        for name in (
            "dram_bytes",
            "ssd_bytes",
            "redis_bytes",
            "session_ttl_s",
            "purge_interval_s",
            "redis_breaker_reset_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.records_map_bytes < 1 << 20:
            raise ValueError(f"records_map_bytes must be >= 1 MiB, got {self.records_map_bytes}")
        if self.redis_timeout_s <= 0 or self.redis_breaker_failures < 1:
            raise ValueError("redis_timeout_s must be > 0 and redis_breaker_failures >= 1")
        from chatstore.redis_security import RedisSecurity

        RedisSecurity.from_config(self).validate(self.redis_url)
        if self.records_url not in ("", "lmdb"):
            if not self.records_url.split("://", 1)[0].lower().startswith("redis"):
                raise ValueError(
                    f"records_url must be '', 'lmdb' or a redis:// URL, got {self.records_url!r}"
                )
            RedisSecurity.from_config(self).validate(self.records_url)
        if not 0 < self.tenant_queue_share <= 1:
            raise ValueError(f"tenant_queue_share must be in (0, 1], got {self.tenant_queue_share}")
        if self.max_context_tokens <= 0:
            raise ValueError(f"max_context_tokens must be positive, got {self.max_context_tokens}")
        if not 0 < self.truncation_ratio < 1:
            raise ValueError(f"truncation_ratio must be in (0, 1), got {self.truncation_ratio}")
        if self.policy not in ("aware", "lru", "fifo"):
            raise ValueError(f"policy must be one of aware, lru, fifo, got {self.policy!r}")
        if self.prefetch_interval_s <= 0:
            raise ValueError(f"prefetch_interval_s must be > 0, got {self.prefetch_interval_s}")
        if self.chunk_tokens <= 0 or self.chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk_tokens must be a positive multiple of block_size ({self.block_size}), "
                f"got {self.chunk_tokens}"
            )
        if self.persist not in ("write_back", "write_through", "off"):
            raise ValueError(
                f"persist must be write_back, write_through or off, got {self.persist!r}"
            )
        if self.persist_lag_s < 0:
            raise ValueError(f"persist_lag_s must be >= 0, got {self.persist_lag_s}")
        if self.write_buffer_bytes <= 0:
            raise ValueError(f"write_buffer_bytes must be > 0, got {self.write_buffer_bytes}")
        if self.read_buffer_layers < -1:
            layers = self.read_buffer_layers
            raise ValueError(f"read_buffer_layers must be -1 (all), 0 (off) or more, got {layers}")
        if self.read_buffer_queue not in ("auto", "on", "off"):
            raise ValueError(
                f"read_buffer_queue must be auto, on or off, got {self.read_buffer_queue!r}"
            )
        if self.read_buffer_bytes < 0:
            raise ValueError(f"read_buffer_bytes must be >= 0, got {self.read_buffer_bytes}")


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Defaults < config file sections < CHATSTORE_* environment < explicit overrides (CLI)."""
    values: dict[str, Any] = {}
    # An installed wheel has no config/ beside the package: the dataclass defaults mirror it.
    files = [DEFAULT_CONFIG_FILE] if DEFAULT_CONFIG_FILE.is_file() else []
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        files.append(Path(path))
    for file in files:
        with file.open("rb") as fh:
            for section in tomllib.load(fh).values():
                values.update(section if isinstance(section, dict) else {})
    environ: Mapping[str, str] = os.environ if env is None else env
    types = {f.name: f.type for f in fields(Config)}
    for name in types:
        raw = environ.get(f"CHATSTORE_{name.upper()}")
        if raw is not None:
            values[name] = _coerce(name, raw, Config.__dataclass_fields__[name].default)
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
    unknown = set(values) - set(types)
    if unknown:
        raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
    return Config(**values).validate()


def _coerce(name: str, raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes", "on")
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"CHATSTORE_{name.upper()} must be a number, got {raw!r}") from None
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"CHATSTORE_{name.upper()} must be an integer, got {raw!r}") from None
    return raw
