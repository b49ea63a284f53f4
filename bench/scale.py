"""The store at scale (issue 23 item 6): a server over 100, 10,000 and 100,000 stored sessions,
and two replicas over one Redis under memory pressure. The real default model and server
(`chatstore serve`'s composition, in a child process per server: one server at a time, nothing
else beside it); the CPU and the dtypes are named in the output.

  population  an LMDB data dir per size, made directly through the store (serving.build's
              store: SessionKVAdmin.create for the records, KVSource.save_turn for chunks), all
              in the local tenant. Every session has its own record (a few turns of messages,
              2 chunks of token ids) and references chunks from a bounded pool: one shared
              system-prompt chunk plus `--pool` distinct second chunks (chunk_tokens = 256
              tokens of KV each: 5.9 MB bf16 / 11.8 MB fp32), so 100,000 sessions fit this
              disk. Cached under --cache keyed by size and pool (reused by later runs);
              population_s, disk_mb and the populating process's peak RSS are reported.
  per size    store_start_s        the store alone opening the dir (create_store + its
                                   SessionKVAdmin, model already loaded), its own process:
                                   until it serves; store_restored_s: until its background
                                   index restore is done
              store_rss_mb         that process's RSS growth from opening the store (restored)
              prefix_match_ms      median SessionKVAdmin.match_prefix of a session-less
                                   client's resent history (a stored session's ids + a new
                                   message), in that process
              purge_s              one purge_expired over the populated store (nothing due:
                                   the steady-state 60 s cycle)
              start_s              server process start to /readyz 200
              restore_s            the session index's restore after that (its own thread:
                                   background_restore; from the server's log); the
                                   conversation starts once it is done
              turn_overhead_ms     one live conversation (POST /v1/sessions/{id}/messages,
                                   streamed): client TTFT minus the engine's own
                                   (timings.engine_ttft_ms), median of turns 2..
              writer_cpu_ms        the store's TurnCommitted.cpu_s per turn (commit listener
                                   in the server process), median
              rss_mb               the server's RSS after the conversation
              openai_prefix_ttft_ms / openai_cached_tokens   the conversation's history resent
                                   to /v1/chat/completions without a session id
  headline    keys named _100k are from the largest size run (`headline_size`: 100,000 in the
              full run), ratios against the smallest (100):
                start_s_100k  turn_overhead_ratio_100k  prefix_match_ms_100k  purge_s_100k
                rss_mb_per_1k_sessions  (server RSS, largest - smallest, per 1,000 sessions)
                writer_cpu_ratio_turn40 (the largest size's conversation runs --turns turns:
                                         writer CPU of turns 38-40 over turns 4-6, means)
  evicting    the smallest and the largest size again (issue 37 item 4), the store alone (its
              own process, model loaded for its fingerprint) over a copy of the populated dir
              with DRAM for --evict-dram-chunks chunks and SSD exactly as large as the
              population's chunks, so both are full: --evict-turns turns, each a new session
              with the shared system chunk (held by every stored session) and one chunk of its
              own, run as the server runs one: the stored prefix read (promoted to DRAM), the
              turn saved, its commit and its write-back to LMDB waited for. Every turn evicts
              from DRAM (its new chunk's room) and from SSD (the write-back's room). After
              --evict-dram-chunks + 2 warm-up turns:
                evict_us             mean wall time of ChunkTiers.pick_victim (the call every
                                     eviction makes, once per victim; per tier beside it), timed
                                     around the real call in that process
                turn_overhead_ms_evicting   median wall time of one such turn
              headline: evict_us_100, evict_us_100k (smallest, largest size), their ratio
              evict_us_ratio_100k, and turn_overhead_ratio_100k_evicting (largest / smallest)
  replicas    two servers (replica ids a and b, DRAM 256 MiB each) over one local KV Redis with
              maxmemory = its empty baseline + --redis-chunks chunks' bytes (10: room for A's
              sessions, about 8 chunks once the allocator rounds each up, not for the two
              replicas' 12) and --redis-policy, records in a second Redis (noeviction,
              records_url, as docs/replicas.md says to deploy); a ~1,000-token system prompt
              shared by
              every session. A serves --replica-sessions sessions (one turn each), then B as
              many (same system prompt, other messages):
                shared_prompt_reuse_share  the tokens B's first session reused from the store
                                           (cached tokens outside the device tier: B has seen
                                           no prompt yet, so they are A's chunks via Redis) /
                                           the chunk-aligned prefix B's prompts share with
                                           A's (rendered by the chat template)
                cross_replica_deletes      chunks B's records reference that were in Redis
                                           before A deleted its sessions and are gone after,
                                           less Redis's own evictions meanwhile (raw counts
                                           beside it)

    python bench/scale.py [--sizes 100,10000,100000] [--quick] [--turns 40] [--pool 128]
                          [--cache DIR] [--repopulate] [--skip-replicas] [--no-progress]
                          [--evict-turns 40] [--evict-dram-chunks 4] [--skip-evicting]
                          [--evicting-only]

A cached dir made by an older record layout is migrated by the store when it opens: run once
with --repopulate after such a change, or the first start measures the migration.

Prints a table; the last line is one JSON object (the goals beside it, under "goals").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import progress  # noqa: E402
from bench.machine import cpu_model, proc_status_mb  # noqa: E402
from tests.chaos.clients import sse_events  # noqa: E402
from tests.chaos.harness import free_port, http_client  # noqa: E402

TENANT = "local"  # the API's tenant in local mode (no keys)
CHUNK = 256
SYSTEM = "You are a helpful assistant. Answer in two sentences."
SHARED_SYSTEM = (
    "You are the support assistant of a company that builds bridges, dams and tunnels. "
    + " ".join(
        f"Rule {i}: answer politely, cite the manual section {i}, and never guess."
        for i in range(60)
    )
)
QUESTIONS = [
    "Tell me about rivers.",
    "Why does that matter?",
    "Give an example.",
    "Say more about the last point.",
    "Summarise in one line.",
]
GREEDY = {"temperature": 0, "max_tokens": 8}
GOALS = {
    "start_s_100k": "<= 5",
    "turn_overhead_ratio_100k": "<= 1.1",
    "prefix_match_ms_100k": "<= 2",
    "writer_cpu_ratio_turn40": "<= 1.2",
    "cross_replica_deletes": "= 0",
    "shared_prompt_reuse_share": ">= 0.95",
    "evict_us_ratio_100k": "<= 2",
    "turn_overhead_ratio_100k_evicting": "<= 1.1",
}
# Every server and store here: local mode, a small device pool and DRAM tier, sessions that
# outlive a cached population (30 days), room for 100,000 sessions (records' map, quota).
SERVER_ENV = {
    "CHATSTORE_API_KEYS": "",
    "CHATSTORE_ADMIN_KEY": "",
    "CHATSTORE_KV_CACHE_BYTES": str(64 << 20),
    "CHATSTORE_DRAM_BYTES": str(256 << 20),
    "CHATSTORE_SESSION_TTL_S": str(30 * 86400),
    "CHATSTORE_RECORDS_MAP_BYTES": str(8 << 30),
    "CHATSTORE_MAX_SESSIONS_PER_TENANT": str(10_000_000),  # all in one tenant, the live one too
    "CHATSTORE_LOG_LEVEL": "warning",
}


def say(*args: Any) -> None:
    print(*args, flush=True)


def label(size: int) -> str:
    return f"{size // 1000}k" if size >= 1000 and size % 1000 == 0 else str(size)


def rss_mb(pid: int | str = "self") -> float:
    return proc_status_mb(pid, "VmRSS")


def child_env(data_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    inherited = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CHATSTORE_") or k in ("CHATSTORE_HOME", "CHATSTORE_DTYPE")
    }
    return {**inherited, **SERVER_ENV, "CHATSTORE_DATA_DIR": str(data_dir), **(extra or {})}


def run_child(mode: str, data_dir: Path, *extra: str, env: dict[str, str] | None = None) -> dict:
    """One child process of this script in `mode`; its last stdout line is its JSON."""
    cmd = [sys.executable, __file__, "--child", mode, "--data-dir", str(data_dir), *extra]
    out = subprocess.run(
        cmd, env=child_env(data_dir, env), cwd=ROOT, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- children: in-process parts (each its own process) ------------------------------------------


def child_serving() -> Any:
    from chatstore.config import load_config
    from chatstore.serving import build

    return build(load_config(env=os.environ))


def pool_ids(vocab: int, j: int) -> list[int]:
    """256 token ids of pool chunk j (j = -1: the shared system chunk), deterministic."""
    base = 1000 + (j + 1) * 7919
    return [(base + 31 * i) % (vocab - 2000) + 1000 for i in range(CHUNK)]


def messages_of(i: int) -> list[dict[str, str]]:
    turns = [{"role": "system", "content": SYSTEM}]
    for k in range(3):
        turns.append({"role": "user", "content": f"Session {i}: {QUESTIONS[k]}"})
        turns.append({"role": "assistant", "content": f"An answer of two sentences, {k}."})
    return turns


def populate(args: argparse.Namespace) -> dict:
    """Records for `args.sessions` sessions; the first `pool` also store their chunks."""
    import torch

    from chatstore.store import kv_quant
    from chatstore.store.ports import SessionKV
    from chatstore.store.records.record import SessionRecord

    t0 = time.perf_counter()
    serving = child_serving()
    kv, api = serving.kv_store, serving.store
    layout, vocab = kv.layout, serving.vocab_size
    shape = (layout.num_layers, 2, 0, layout.num_kv_heads, layout.head_dim)
    pool = min(args.pool, args.sessions)
    chains: list[list[str]] = []
    gen = torch.Generator().manual_seed(0)

    def builder(plan: Any) -> Any:
        def build() -> dict:
            out = {}
            for _, key, a, b in plan.new_spans():
                kvs = torch.randn((*shape[:2], b - a, *shape[3:]), generator=gen)
                out[key] = SessionKV(plan.token_ids[a:b], kv_quant.convert(kvs, kv.storage_dtype))
            return out

        return build

    system = pool_ids(vocab, -1)
    for i in progress.track(range(args.sessions), f"populate {args.sessions}"):
        sid, j = f"s{i:06d}", i % pool
        ids = system + pool_ids(vocab, j)
        if i < pool:  # a pool chunk's first owner stores it through the store's turn save
            api.create(SessionRecord(TENANT, sid, messages=messages_of(i)))
            plan = kv.plan_turn(TENANT, ids, None, 0)
            kv.save_plan(TENANT, sid, plan, builder(plan), len(ids) * kv.bytes_per_token)
            chains.append([c.digest for c in plan.chain])
            if i % 16 == 15:
                kv.flush_writes(120)
        else:
            record = SessionRecord(
                TENANT, sid, messages=messages_of(i), token_ids=ids, chunks=chains[j],
                fingerprint=kv.fingerprint,
            )  # fmt: skip
            api.create(record)
    kv.flush_writes(120)
    kv.flush_persist(120)
    serving.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "sessions": args.sessions,
        "pool_chunks": pool + 1,
        "population_s": time.perf_counter() - t0,
        "populate_peak_rss_mb": peak,
        "storage_dtype": str(kv.storage_dtype).removeprefix("torch."),
        "chunk_mb": CHUNK * kv.bytes_per_token / 2**20,
    }


def probe(args: argparse.Namespace) -> dict:
    """The store alone over the populated dir: its start, RSS, prefix match, purge cycle."""
    from chatstore.config import load_config
    from chatstore.engine.runtime import create_runtime
    from chatstore.store.attention_store import create_store
    from chatstore.store.session_store import SessionStore

    config = load_config(env=os.environ)
    runtime = create_runtime(config)
    model = runtime.model
    before = rss_mb()
    t0 = time.perf_counter()
    kv = create_store(config, model.spec, model.fingerprint)
    api = SessionStore(kv.records, kv)
    start = time.perf_counter() - t0  # serving from here (the index restores behind)
    kv.restore.wait()
    restored = time.perf_counter() - t0
    grown = rss_mb() - before  # with every session's chain in the index
    vocab, pool = model.spec.vocab_size, min(args.pool, args.sessions)
    times, matched = [], 0
    for k in range(40):
        ids = pool_ids(vocab, -1) + pool_ids(vocab, k % pool) + list(range(500, 540))
        t = time.perf_counter()
        found = api.match_prefix(TENANT, ids)
        times.append(time.perf_counter() - t)
        matched += found is not None
    t = time.perf_counter()
    purged = api.purge_expired()
    purge = time.perf_counter() - t
    count = api.count_sessions(TENANT)
    api.close()
    return {
        "store_start_s": start,
        "store_restored_s": restored,
        "store_rss_mb": grown,
        "prefix_match_ms": 1000 * statistics.median(times[5:]),
        "prefix_matched": matched / len(times),
        "purge_s": purge,
        "purged": purged,
        "sessions_counted": count,
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "storage_dtype": str(kv.storage_dtype).removeprefix("torch."),
    }


def time_victims(tiers: Any) -> dict[str, list[float]]:
    """Seconds of each victim choice, by tier: the tiers' own pick_victim, wrapped on this
    instance (a store from before it: the placement's choose_victim, what it called then)."""
    times: dict[str, list[float]] = {}
    owner, name = (
        (tiers, "pick_victim")
        if hasattr(tiers, "pick_victim")
        else (tiers.placement, "choose_victim")
    )
    real = getattr(owner, name)

    def timed(tier: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(tier, *args)
        finally:
            spent = time.perf_counter() - t0
            times.setdefault(getattr(tier, "name", tier), []).append(spent)

    setattr(owner, name, timed)
    return times


def evicting(args: argparse.Namespace) -> dict:
    """The evicting case (module doc): the store alone over a populated copy whose DRAM and
    SSD are full; every turn evicts from both."""
    import torch

    from chatstore.config import load_config
    from chatstore.engine.runtime import create_runtime
    from chatstore.store import kv_quant
    from chatstore.store.attention_store import create_store
    from chatstore.store.ports import SessionKV

    config = load_config(env=os.environ)
    model = create_runtime(config).model
    kv = create_store(config, model.spec, model.fingerprint)
    assert kv is not None
    kv.restore.wait()
    times = time_victims(kv.tiers)
    layout, vocab, C = kv.layout, model.spec.vocab_size, CHUNK
    shape = (layout.num_layers, 2, C, layout.num_kv_heads, layout.head_dim)
    rows = kv_quant.convert(torch.randn(shape, generator=torch.Generator().manual_seed(0)),
                            kv.storage_dtype)  # fmt: skip
    system, warmup = pool_ids(vocab, -1), args.evict_dram_chunks + 2
    turn_ms: list[float] = []
    counted = {name: 0 for name in ("dram", "ssd")}
    for t in progress.track(range(warmup + args.evict_turns), f"evicting {args.sessions}"):
        if t == warmup:  # steady state from here: both tiers full
            times.clear()
            counted = {n: kv.tiers.counters.tier(n).evictions for n in counted}
        ids = system + pool_ids(vocab, 100_000 + t)  # the system chunk + one of its own
        t0 = time.perf_counter()
        plan = kv.plan_turn(TENANT, ids, None, 0)
        new = set(plan.new_chunks)
        for chunk in plan.chain:
            if chunk not in new:
                kv.tiers.get(chunk)  # the turn's load of its stored prefix: up to DRAM

        def build(plan: Any = plan) -> dict:
            return {key: SessionKV(plan.token_ids[a:b], rows[:, :, : b - a])
                    for _, key, a, b in plan.new_spans()}  # fmt: skip

        kv.save_plan(TENANT, f"evicting{t:05d}", plan, build, len(ids) * kv.bytes_per_token)
        kv.flush_writes(120)  # its commit: the new chunk into DRAM, a DRAM victim out
        kv.flush_persist(120)  # its write-back: into LMDB, an SSD victim out
        if t >= warmup:
            turn_ms.append(1000 * (time.perf_counter() - t0))
    out: dict[str, Any] = {
        "turn_overhead_ms_evicting": statistics.median(turn_ms),
        "evicting_turn_ms_by_turn": turn_ms,
        "evict_path": "pick_victim" if hasattr(kv.tiers, "pick_victim") else "choose_victim",
    }
    every = [x for spent in times.values() for x in spent]
    out["evict_us"] = 1e6 * statistics.mean(every) if every else float("nan")
    for name in counted:
        spent = times.get(name, [])
        out[f"evict_us_{name}"] = 1e6 * statistics.mean(spent) if spent else float("nan")
        out[f"victims_{name}"] = len(spent)
        out[f"evictions_{name}"] = kv.tiers.counters.tier(name).evictions - counted[name]
    out["evicting_turns"] = len(turn_ms)
    kv.close()
    return out


def serve(args: argparse.Namespace) -> None:
    """`chatstore serve` (server/run.py run_server) with a commit listener that appends
    each commit's writer CPU to --cpu-log."""
    import torch

    from chatstore.api.common.app import create_app
    from chatstore.api.common.settings import ServerSettings
    from chatstore.config import load_config
    from chatstore.cpu_threads import in_temporary_thread, leave_cores_to_engine
    from chatstore.server.run import (
        SWITCH_INTERVAL_S,
        DrainingServer,
        configure_logging,
        uvicorn_config,
    )
    from chatstore.serving import build

    config = load_config(overrides={"port": args.port}, env=os.environ)
    settings = ServerSettings.from_config(config)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    configure_logging(settings.log_level)
    cores = torch.get_num_threads()
    serving = in_temporary_thread(build, config)
    if serving.engine.device_type == "cpu":
        serving.engine.compute_threads = cores
        leave_cores_to_engine()
    log = open(args.cpu_log, "a", buffering=1)  # noqa: SIM115 (the server's lifetime)

    def committed(c: Any) -> None:
        log.write(json.dumps({"session": c.key.session_id, "cpu_s": c.cpu_s}) + "\n")

    if serving.kv_store is not None:
        kv = serving.kv_store
        kv.add_commit_listener(committed)

        def restored() -> None:  # the background index restore's end, for restore_s
            kv.restore.wait()
            log.write(json.dumps({"restore_s": kv.restore.seconds}) + "\n")

        threading.Thread(target=restored, daemon=True).start()
    app = create_app(serving, settings)
    DrainingServer(uvicorn_config(app, settings), app.state.service).run()


def prefix_len(args: argparse.Namespace) -> dict:
    """Tokens two sessions with SHARED_SYSTEM and different first messages share."""
    from chatstore.api.common.chat_template import ChatTemplate
    from chatstore.config import load_config
    from chatstore.engine.runtime import runtime_config
    from chatstore.model.loader import load_model

    config = load_config(env=os.environ)
    model = load_model(config.model, dtype=config.torch_dtype, device="cpu")
    spec, dtype = model.spec, runtime_config(config, model).storage_torch_dtype
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * dtype.itemsize
    template = ChatTemplate(model.tokenizer, model.spec.eos_token_ids)
    a, b = (
        template.render(
            [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": q}]
        )
        for q in (replica_question("a", 0), replica_question("b", 0))
    )
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    reusable = common // CHUNK * CHUNK
    return {"common_tokens": common, "reusable_tokens": reusable, "chunk_bytes": CHUNK * per_token}


# -- the parent: servers and clients ------------------------------------------------------------


class Server:
    """A serve child on a free port; start_s from process start to /readyz 200."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir, self.port = data_dir, free_port()
        self.cpu_log = data_dir.parent / f"{data_dir.name}-commits.jsonl"
        self.cpu_log.unlink(missing_ok=True)
        self.log_path = data_dir.parent / f"{data_dir.name}-server.log"
        self.log_path.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--child", "serve", "--data-dir", str(data_dir)]
        cmd += ["--port", str(self.port), "--cpu-log", str(self.cpu_log)]
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=child_env(data_dir, env), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def _wait_ready(self) -> None:
        with http_client(self.url, 1.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
                try:
                    if http.get("/readyz").status_code == 200:
                        return
                except Exception:
                    pass
                time.sleep(0.02)

    def commits(self) -> list[dict]:
        if not self.cpu_log.exists():
            return []
        return [json.loads(line) for line in self.cpu_log.read_text().splitlines() if line]

    def restore_s(self, timeout: float = 300.0) -> float | None:
        """Seconds the store's background index restore took, once it is done (the serve
        child writes it to the commit log); None when it never says."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.cpu_log.read_text().splitlines() if self.cpu_log.exists() else []:
                if '"restore_s"' in line:
                    return float(json.loads(line)["restore_s"])
            time.sleep(0.2)
        return None

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def streamed(http: Any, path: str, body: dict) -> tuple[float, dict]:
    """(client TTFT in seconds, the last event)."""
    t0, ttft, last = time.perf_counter(), None, {}
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        response.raise_for_status()
        for event in sse_events(response.iter_lines()):
            piece = event.get("text") or "".join(
                (c.get("delta") or {}).get("content") or "" for c in event.get("choices", [])
            )
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            last = event
    return ttft or time.perf_counter() - t0, last


def new_commits(server: Server, sid: str, seen: int, timeout_s: float = 30.0) -> list[float]:
    """The writer CPU (s) of `sid`'s commits after its first `seen`, once there is one."""
    deadline = time.monotonic() + timeout_s
    while True:
        mine = [c["cpu_s"] for c in server.commits() if c.get("session") == sid]
        if len(mine) > seen or time.monotonic() > deadline:
            return mine[seen:]
        time.sleep(0.02)


def conversation(server: Server, turns: int) -> dict:
    """One live session: per-turn server overhead and writer CPU; then its history resent by a
    session-less OpenAI client."""
    overhead, cpu, seen = [], [], 0
    with http_client(server.url, 300.0) as http:
        http.delete("/v1/sessions/live")  # left by a run that stopped half-way (else a 404)
        http.post("/v1/sessions", json={"id": "live", "system_prompt": SYSTEM}).raise_for_status()
        for t in progress.track(range(turns), "live conversation"):
            content = f"Turn {t}: {QUESTIONS[t % len(QUESTIONS)]}"
            ttft, done = streamed(
                http, "/v1/sessions/live/messages", {"content": content, **GREEDY}
            )
            engine = (done.get("timings") or {}).get("engine_ttft_ms")
            overhead.append(1000 * ttft - engine if engine is not None else float("nan"))
            # A turn's commit lands on the writer thread after the reply: wait for it.
            mine = new_commits(server, "live", seen)
            seen += len(mine)
            cpu.append(1000 * sum(mine) if mine else float("nan"))
        history = [{"role": m["role"], "content": m["content"]}
                   for m in http.get("/v1/sessions/live").json()["messages"]]  # fmt: skip
        body = {"messages": [*history, {"role": "user", "content": "One more thing?"}], **GREEDY}
        body["stream_options"] = {"include_usage": True}  # the last event then has the usage
        ttft, done = streamed(http, "/v1/chat/completions", body)
    cached = ((done.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {
        "turn_overhead_ms": statistics.median(overhead[1:]),
        "writer_cpu_ms": statistics.median(cpu[1:]),
        "overhead_ms_by_turn": overhead,
        "writer_cpu_ms_by_turn": cpu,
        "openai_prefix_ttft_ms": 1000 * ttft,
        "openai_cached_tokens": cached,
    }


def du_mb(path: Path) -> float:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()) / 2**20


def populated(args: argparse.Namespace, size: int) -> tuple[Path, dict]:
    """The cached population of `size` sessions (made now if missing, or once per run with
    --repopulate) and its populated.json."""
    data_dir = Path(args.cache) / f"scale-{size}-pool{args.pool}"
    done = data_dir / "populated.json"
    made_now: set[int] = args.__dict__.setdefault("populated_now", set())
    if (args.repopulate and size not in made_now) or not done.exists():
        shutil.rmtree(data_dir, ignore_errors=True)
        say(f"  populating {size} sessions in {data_dir}")
        made = run_child("populate", data_dir, "--sessions", str(size), "--pool", str(args.pool))
        made["disk_mb"] = du_mb(data_dir)
        done.write_text(json.dumps(made))
        made_now.add(size)
    return data_dir, json.loads(done.read_text())


def measure_evicting(args: argparse.Namespace, size: int) -> dict:
    """The evicting case on a copy of the population (its evictions delete population chunks
    from LMDB: the cached dir stays as it was)."""
    source, made = populated(args, size)
    work = Path(args.cache) / f"evicting-{size}-pool{args.pool}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(source, work)
    chunk = round(made["chunk_mb"] * 2**20)  # one chunk's KV bytes: its DRAM footprint
    lmdb_chunk = chunk + 4 * CHUNK + 512  # and in LMDB (tiers/base.py: encoded_footprint)
    env = {
        "CHATSTORE_DRAM_BYTES": str(args.evict_dram_chunks * chunk),
        "CHATSTORE_SSD_BYTES": str(made["pool_chunks"] * lmdb_chunk),  # full as it opens
    }
    extra = ["--sessions", str(size), "--pool", str(args.pool)]
    extra += ["--evict-turns", str(args.evict_turns)]
    extra += ["--evict-dram-chunks", str(args.evict_dram_chunks)]
    try:
        return run_child("evicting", work, *extra, env=env)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure_size(args: argparse.Namespace, size: int, turns: int) -> dict:
    data_dir, made = populated(args, size)
    out: dict[str, Any] = dict(made)
    out |= run_child("probe", data_dir, "--sessions", str(size), "--pool", str(args.pool))
    # The server runs on the cached dir itself: the live session is deleted at the end, so the
    # next run finds the population as it was.
    server = Server(data_dir)
    try:
        out["start_s"] = server.start_s
        # The session index is restored after /readyz (background_restore): the per-turn
        # numbers are the steady state's, so the conversation starts once it is done.
        out["restore_s"] = server.restore_s()
        out |= conversation(server, turns)
        out["rss_mb"] = server.rss_mb()
        with http_client(server.url, 60.0) as http:
            http.delete("/v1/sessions/live")
    finally:
        server.stop()
    return out


# -- two replicas over one Redis ------------------------------------------------------------------


def replica_question(replica: str, i: int) -> str:
    return f"Replica {replica}, customer {i}: {QUESTIONS[i % len(QUESTIONS)]}"


def redis_chunk_digests(client: Any) -> set[str]:
    from chatstore.store.tiers.redis import NAMESPACE

    found = set()
    for name in client.scan_iter(match=f"{NAMESPACE}:*", count=1000):
        text = name.decode() if isinstance(name, bytes) else name
        if "{" in text:
            found.add(text.rsplit("{", 1)[1].rstrip("}"))
    return found


def replicas(args: argparse.Namespace, work: Path) -> dict:
    import redis as redis_lib

    from chatstore.store.records.redis import RedisRecordStore
    from chatstore.store.sealing import Keyring, Sealer
    from chatstore.store.sealing.key_store_redis import RedisKeyStore
    from chatstore.store.sealing.master_key import new_secret_line, parse_secrets
    from chatstore.store.session_kv import SessionKey
    from chatstore.store.tiers.redis import connect_redis
    from tests.support.redis_server import start_local_redis

    shared = run_child("prefix-len", work / "tokens")
    local = start_local_redis()
    # The records in a Redis of their own that never evicts (deploy/redis-records.conf), as
    # docs/replicas.md says to run replicas: only KV is under memory pressure.
    records_redis = start_local_redis(policy="noeviction")
    client = redis_lib.Redis.from_url(local.url)
    # Room for --redis-chunks chunks on top of what the empty Redis already uses (its own
    # baseline would otherwise eat part of it); the allocator rounds each 5.6 MiB value up.
    baseline = int(client.info("memory")["used_memory"])
    maxmemory = baseline + args.redis_chunks * shared["chunk_bytes"]
    client.config_set("maxmemory", str(maxmemory))
    client.config_set("maxmemory-policy", args.redis_policy)
    secret = new_secret_line("k1")  # the replicas share a cluster's key: each opens the other's
    env = {"CHATSTORE_REDIS_URL": local.url, "CHATSTORE_PERSIST_LAG_S": "0.2"}
    env["CHATSTORE_RECORDS_URL"] = records_redis.url
    env["CHATSTORE_SECRET_KEY"] = secret
    n, out = args.replica_sessions, {"redis_maxmemory_mb": maxmemory / 2**20}
    out |= {"redis_policy": args.redis_policy, **shared}
    servers: list[Server] = []
    try:
        a = Server(work / "a", {**env, "CHATSTORE_REPLICA_ID": "a"})
        servers.append(a)
        b = Server(work / "b", {**env, "CHATSTORE_REPLICA_ID": "b"})
        servers.append(b)
        body = {"system_prompt": SHARED_SYSTEM}
        by_tier: list[dict[str, int]] = []
        for name, server in (("a", a), ("b", b)):
            with http_client(server.url, 300.0) as http:
                for i in progress.track(range(n), f"replica {name} sessions"):
                    sid = f"{name}{i}"
                    http.post("/v1/sessions", json={"id": sid, **body}).raise_for_status()
                    path = f"/v1/sessions/{sid}/messages"
                    reply = http.post(path, json={"content": replica_question(name, i), **GREEDY})
                    reply.raise_for_status()
                    usage = reply.json()["usage"]
                    if name == "b":
                        by_tier.append(usage["cached_tokens_by_tier"])
            time.sleep(1.0)  # write-back (persist_lag_s 0.2) reaches Redis
        # b0 is the first prompt b sees: all it reuses is the store's (a's chunks, via Redis);
        # b's later sessions also find the prompt in b's own device prefix cache.
        reused = sum(n for tier, n in by_tier[0].items() if tier != "device")
        out["shared_prompt_reuse_share"] = min(1.0, reused / max(1, shared["reusable_tokens"]))
        out["b_cached_tokens_by_tier"] = by_tier
        keys = RedisKeyStore(connect_redis(records_redis.url, 5.0))  # the replicas' data keys
        records = RedisRecordStore(
            records_redis.url, sealer=Sealer(Keyring(parse_secrets(secret, "bench"), keys))
        )
        referenced: set[str] = set()
        for i in range(n):
            record = records.get(SessionKey(TENANT, f"b{i}"))
            out["b_records_lost"] = out.get("b_records_lost", 0) + (record is None)
            referenced |= set(record.chunks if record is not None else [])
        before = referenced & redis_chunk_digests(client)
        evicted0 = int(client.info("stats")["evicted_keys"])
        with http_client(a.url, 120.0) as http:
            for i in range(n):
                http.delete(f"/v1/sessions/a{i}").raise_for_status()
        time.sleep(1.0)
        gone = before - redis_chunk_digests(client)
        evicted = int(client.info("stats")["evicted_keys"]) - evicted0
        out |= {"b_chunks_in_redis_before": len(before), "b_chunks_gone_after": len(gone)}
        out |= {"redis_evicted_meanwhile": evicted}
        out["cross_replica_deletes"] = max(0, len(gone) - evicted)
        out["redis_evicted_keys"] = int(client.info("stats")["evicted_keys"])
        out["redis_used_mb"] = int(client.info("memory")["used_memory"]) / 2**20
        records.close()
    finally:
        for server in servers:
            server.stop()
        local.stop()
        records_redis.stop()
    return out


# -- main ---------------------------------------------------------------------------------------


def headline(per_size: dict[int, dict], turns: int) -> dict:
    small, large = min(per_size), max(per_size)
    lo, hi = per_size[small], per_size[large]
    cpu = hi["writer_cpu_ms_by_turn"]
    early, late = cpu[3:6], cpu[max(6, turns - 3) : turns]
    sessions = max(1, large - small)
    return {
        "headline_size": large,
        "baseline_size": small,
        "start_s_100k": hi["start_s"],
        "store_start_s_100k": hi["store_start_s"],
        "store_restored_s_100k": hi["store_restored_s"],
        "server_restore_s_100k": hi["restore_s"],
        "turn_overhead_ratio_100k": hi["turn_overhead_ms"] / lo["turn_overhead_ms"],
        "prefix_match_ms_100k": hi["prefix_match_ms"],
        "purge_s_100k": hi["purge_s"],
        "rss_mb_per_1k_sessions": (hi["rss_mb"] - lo["rss_mb"]) / sessions * 1000,
        "writer_cpu_ratio_turn40": statistics.mean(late) / statistics.mean(early),
        "writer_cpu_turns": [turns - len(late) + 1, turns],
    }


def evicting_headline(per_size: dict[int, dict]) -> dict:
    lo, hi = per_size[min(per_size)], per_size[max(per_size)]
    return {
        "evict_us_100": lo["evict_us"],
        "evict_us_100k": hi["evict_us"],
        "evict_us_ratio_100k": hi["evict_us"] / lo["evict_us"],
        "turn_overhead_ratio_100k_evicting": (
            hi["turn_overhead_ms_evicting"] / lo["turn_overhead_ms_evicting"]
        ),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100,10000,100000", help="stored sessions per run")
    p.add_argument(
        "--quick", action="store_true", help="sizes 100,1000; 10 turns; 2 replicas' sessions"
    )
    p.add_argument("--turns", type=int, default=40, help="the largest size's conversation")
    p.add_argument("--small-turns", type=int, default=8, help="the other sizes' conversation")
    p.add_argument("--pool", type=int, default=128, help="distinct second chunks")
    p.add_argument("--cache", default=str(ROOT / "bench" / "out" / "scale"), help="populated dirs")
    p.add_argument("--repopulate", action="store_true", help="rebuild cached dirs (new layout)")
    p.add_argument("--skip-replicas", action="store_true")
    p.add_argument("--replica-sessions", type=int, default=4)
    p.add_argument(
        "--redis-chunks", type=int, default=10, help="Redis maxmemory above its baseline, in chunks"
    )
    p.add_argument("--redis-policy", default="allkeys-lru")
    p.add_argument("--evict-turns", type=int, default=40, help="the evicting case's turns")
    p.add_argument(
        "--evict-dram-chunks", type=int, default=4, help="the evicting case's DRAM, in chunks"
    )
    p.add_argument("--skip-evicting", action="store_true", help="no evicting case")
    p.add_argument(
        "--evicting-only", action="store_true", help="only the evicting case (and populations)"
    )
    p.add_argument(
        "--child",
        choices=["populate", "probe", "serve", "prefix-len", "evicting"],
        help=argparse.SUPPRESS,
    )
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    p.add_argument("--sessions", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cpu-log", help=argparse.SUPPRESS)
    progress.add_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.turns, args.small_turns = "100,1000", min(args.turns, 10), 6
        args.pool, args.replica_sessions = min(args.pool, 16), 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    progress.configure(args)
    if args.child is not None:
        progress.configure(argparse.Namespace(no_progress=True))
        if args.child == "serve":
            serve(args)
            return
        children = {
            "populate": populate,
            "probe": probe,
            "prefix-len": prefix_len,
            "evicting": evicting,
        }
        print(json.dumps(children[args.child](args)), flush=True)
        return
    # A SIGTERM unwinds like ^C: the servers and the Redis this run started stop with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    say(f"CPU: {cpu_model()} ({os.cpu_count()} cores); cache {args.cache}")
    result: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count()}
    per_size: dict[int, dict] = {}
    for size in [] if args.evicting_only else sizes:
        turns = args.turns if size == sizes[-1] else args.small_turns
        r = measure_size(args, size, turns)
        per_size[size] = r
        say(
            f"{label(size):>6} sessions: start {r['start_s']:.2f} s"
            f" (store {r['store_start_s']:.2f} s, index restored after"
            f" {r['store_restored_s']:.2f} s; server's {r['restore_s']})"
            f", turn overhead {r['turn_overhead_ms']:.1f} ms"
            f", writer CPU {r['writer_cpu_ms']:.2f} ms"
            f", prefix match {r['prefix_match_ms']:.3f} ms, purge {r['purge_s']:.3f} s"
            f", RSS {r['rss_mb']:.0f} MB, disk {r['disk_mb']:.0f} MB"
            f" (populated in {r['population_s']:.0f} s, dtype {r['storage_dtype']})"
        )
    if per_size:
        result["model_dtype"] = per_size[sizes[-1]]["model_dtype"]
        result["storage_dtype"] = per_size[sizes[-1]]["storage_dtype"]
        result |= headline(per_size, args.turns)
    if not args.skip_evicting or args.evicting_only:
        evict: dict[int, dict] = {}
        for size in sorted({sizes[0], sizes[-1]}):
            r = evict[size] = measure_evicting(args, size)
            per_size.setdefault(size, {}).update(r)
            say(
                f"{label(size):>6} sessions, evicting: victim chosen in {r['evict_us']:.1f} us"
                f" (DRAM {r['evict_us_dram']:.1f}, SSD {r['evict_us_ssd']:.1f}; victims"
                f" {r['victims_dram']} / {r['victims_ssd']} over {r['evicting_turns']} turns)"
                f", turn {r['turn_overhead_ms_evicting']:.1f} ms ({r['evict_path']})"
            )
        result |= evicting_headline(evict)
    if not args.skip_replicas and not args.evicting_only:
        with tempfile.TemporaryDirectory(prefix="scale-replicas-") as work:
            rep = replicas(args, Path(work))
        say(
            f"replicas: shared prompt reuse {rep['shared_prompt_reuse_share']:.2f}, cross-replica"
            f" deletes {rep['cross_replica_deletes']} (gone {rep['b_chunks_gone_after']}, evicted"
            f" {rep['redis_evicted_meanwhile']}), Redis {rep['redis_used_mb']:.0f} MB used"
        )
        result |= {k: rep[k] for k in ("cross_replica_deletes", "shared_prompt_reuse_share")}
        result["replicas"] = rep
    result["per_size"] = {label(s): r for s, r in per_size.items()}
    result["goals"] = GOALS
    for key, goal in GOALS.items():
        if key in result:
            say(f"  {key:<28} {result[key]!s:<24} goal {goal}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
