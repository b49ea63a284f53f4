"""Store v2 (session KV as chunks): what a turn writes, what the store costs, what it shares, what
it saves under pressure, and how warm a server comes back after kill -9. The real default model
behind the real AsyncEngine (built as the server builds it), store on vs off in the same run.

  conversation   one session, 40 turns growing to ~8K tokens, run three ways: store off (the
                 device prefix cache holds the history), DRAM tier, LMDB tier alone (DRAM 0).
                 Each turn goes through the API's ChatService as POST /v1/sessions/{id}/messages
                 does (no HTTP): the prompt is built from the session's record, and the turn's
                 messages are appended to the record before the turn returns. The DRAM run has
                 every tier a turn reaches with the default persist = write_back: DRAM, the
                 LMDB KV tier (write-back of the chunks a turn stored), and a local Redis
                 (`--redis auto`: when redis-server exists), to which write-back copies the
                 same chunks and where the records (and the session leases) then live instead
                 of the records LMDB env; without Redis the records go to records.lmdb. After
                 each turn the bench waits for the writer (flush_writes) and the write-back
                 (flush_persist), so a turn's writes land in that turn.
                   bytes_written_ratio_max   max over turns (from the 2nd) of the store's own
                   (and _mean)               counter `bytes_written` (chunk bytes its writer
                                             handed to the tiers: DRAM only, here) / the new
                                             tokens' KV bytes (DRAM run)
                   bytes_written_ratio_max_all_tiers   (and _mean_all_tiers) the same with
                                             everything written that turn (bench/tier_bytes.py):
                                               DRAM      the KV rows the DRAM tier wrote
                                                         into its pool (memory writes show
                                                         up in no system call)
                                             + every byte the process wrote to a file
                                               (/proc/self/io wchar: LMDB's pwrite of its
                                               pages, rewritten ones included)
                                             + every byte its Redis clients handed to their
                                               sockets (checked against the server's own
                                               INFO total_net_input_bytes: redis_in),
                                             split by the calling thread's bytes around each
                                             call into:
                                               lmdb_kv   the LMDB KV tier's puts and deletes
                                               redis_kv  the Redis KV tier's puts and deletes
                                               records   the record store's writes: the
                                                         store's upsert of token ids and chunk
                                                         list, the API's append of messages
                                               other     the rest (lease and read commands to
                                                         Redis, a log line)
                                             goal <= 1.5 (the new tokens' KV plus one chunk
                                             of re-keyed tail, records included).
                                             The new tokens: this turn's history minus what
                                             was both stored and reused from cache.
                   bytes_all_tiers_max_turn  that breakdown for the turn with the max ratio
                                             (bytes; per-turn lists in the conversation's
                                             bytes_by_turn, with new_chunks_kv: the KV of the
                                             chunks the turn created, which write-back copies
                                             down, and redis_in: what the Redis server says it
                                             received, INFO total_net_input_bytes)
                   save_cpu_ms_turn5/40      writer-thread CPU time of the turn's save
                   lmdb_ttft_ratio           last five turns' TTFT, LMDB-only over store off
                   dram_ttft_ratio           the same from DRAM
                   data_dir_ratio            data dir at the end (LMDB run) / the session's KV
  overhead       6 sessions, histories to ~1.5K tokens, all fit the device pool: later-turn TTFT
                 store on / off (prefix cache on in both), runs ordered on, off, off, on
                   store_overhead_ratio
  shared prefix  32 sessions with one ~1K-token system prompt, 2 turns each
                   dedup_ratio               DRAM bytes / (one prompt + the sessions' own tokens)
  pressure       device pool of ~4K tokens, 32 sessions (a ~400-token opening message, then 3
                 short follow-ups), DRAM tier
                   pressure_ttft_ratio       later-turn TTFT store on / off
  warm restart   a child process serves 6 sessions of ~4K tokens, waits past persist_lag_s, is
                 killed with -9; a fresh process continues every session
                   warm_restart_share        sessions whose whole history came back from LMDB
                   warm_restart_ttft_ratio   their first-turn TTFT / a cold recompute's

    python bench/store_io.py [--quick] [--only conversation,overhead,...] [--plot-dir bench/out]
                             [--redis auto|on|off] [--no-progress]

Run it with --no-progress (or stderr not a terminal) for the byte counts: a progress bar drawn
during a turn lands in that turn's `other`.

The conversation section writes two plots to the plot dir: store_io_bytes_per_turn.png (what
the DRAM run wrote each turn, by the store's counter and on every tier, against the new tokens'
KV and the whole history's KV, which is what a store that rewrites the session every turn would
write) and store_io_ttft_by_turn.png (TTFT per turn: store off, DRAM tier, LMDB tier alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import plots, progress  # noqa: E402
from bench.tier_bytes import TierBytes  # noqa: E402
from chatstore.api.chat.service import ChatService, TurnSpec  # noqa: E402
from chatstore.api.common.settings import ServerSettings  # noqa: E402
from chatstore.config import load_config  # noqa: E402
from chatstore.engine.request import Request, SamplingParams  # noqa: E402
from chatstore.serving import build  # noqa: E402
from tests.support.redis_server import redis_server_binary, start_local_redis  # noqa: E402

TEXT = (ROOT / "tests" / "data" / "declaration_and_lincoln.txt").read_text().split()
TENANT = "local"  # the API's tenant in local mode (no keys)
SECTIONS = ("conversation", "overhead", "dedup", "pressure", "restart")


@dataclass
class TurnResult:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    reply: list[int] = field(default_factory=list)


class Rig:
    """One Serving (runtime + store + engine) as the server builds it, driven in-process."""

    def __init__(self, data_dir: str, **overrides) -> None:
        overrides = {"data_dir": data_dir, "max_context_tokens": 8192, **overrides}
        self.config = load_config(overrides=overrides, env={})
        self.serving = build(self.config)
        self.engine = self.serving.engine
        self.tok = self.engine.tokenizer
        self.store = self.serving.kv_store  # the AttentionStore (None with kv_store off)
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._start())
        self._n = 0
        self._service: ChatService | None = None

    async def _start(self) -> None:
        self.engine.start()

    def turn(self, session: str, messages: list[dict], max_tokens: int) -> TurnResult:
        ids = self.tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        return self.turn_ids(session, list(ids), max_tokens)

    def turn_ids(self, session: str, ids: list[int], max_tokens: int) -> TurnResult:
        self._n += 1
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(f"r{self._n}", ids, sampling, tenant="local", session_id=session)
        if self.store is not None:  # the API opens the turn: LMDB / Redis chunks to host memory
            request.store_turn = self.store.open_turn("local", session)

        async def run() -> TurnResult:
            first = usage = None
            reply: list[int] = []
            async for out in self.engine.submit(request):
                first = first or out.first_token_time
                reply += [t for s in out.samples for t in s.token_ids]
                usage = out.usage or usage
            return TurnResult(first - request.arrival_time, len(ids), usage.cached_tokens, reply)

        result = self.loop.run_until_complete(run())
        if self.store is not None:
            # As the API does before it records the turn: the turn's KV is committed (or at
            # least in the write buffer) before the next turn of the session can open. Without
            # it the next turn may look up its history while the last chunk is still being
            # sealed, and find one chunk fewer. TTFT above is unaffected.
            self.store.wait_saved("local", session)
        return result

    @property
    def service(self) -> ChatService:
        """The API's ChatService over this Serving, as create_app builds it (no HTTP)."""
        if self._service is None:
            s = self.serving
            settings = ServerSettings.from_config(self.config, env={})
            self._service = ChatService(s.engine, s.store, s.template, settings, s.vocab_size)
        return self._service

    def open_session(self, session: str, system_prompt: str) -> None:
        """POST /v1/sessions: the session's record, with its system message."""
        self.service.create_session(TENANT, system_prompt, {}, session)

    def session_turn(self, session: str, content: str, max_tokens: int) -> TurnResult:
        """POST /v1/sessions/{id}/messages without the HTTP: the service renders the prompt
        from the record (the stored token ids plus the new message when they still match),
        runs it, and appends the turn's messages to the record before returning. TTFT is
        the engine's, as in turn_ids."""
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        spec = TurnSpec(
            tenant=TENANT,
            sampling=sampling,
            started=time.perf_counter(),
            session_id=session,
            new_message={"role": "user", "content": content},
            create_missing=False,
            api="sessions",
        )

        async def run() -> TurnResult:
            turn = await self.service.open_turn(spec)
            result = await turn.run()
            if result.error is not None or turn.save_error is not None:
                raise RuntimeError(f"turn failed: {result.error or turn.save_error}")
            assert result.engine_ttft_s is not None
            ids = turn.request.prompt_token_ids
            reply = result.token_ids[0]
            return TurnResult(result.engine_ttft_s, len(ids), result.usage.cached_tokens, reply)

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.shutdown())
        self.loop.close()
        self.serving.close()


def words(start: int, n: int) -> str:
    return " ".join(TEXT[(start + i) % len(TEXT)] for i in range(n))


def say(*args) -> None:
    print(*args, flush=True)


# -- one long conversation ------------------------------------------------------------------


def conversation(args, mode: str, data_dir: str) -> dict:
    overrides = {"kv_store": "off"} if mode == "off" else {}
    if mode == "lmdb":
        overrides["dram_bytes"] = 0
    redis = None
    if mode == "dram" and args.redis != "off":
        if redis_server_binary() is not None:
            redis = start_local_redis()
            overrides["redis_url"] = redis.url
        elif args.redis == "on":
            raise SystemExit("--redis on: redis-server is not installed")
        else:
            say("  no redis-server: the DRAM run has no Redis tier (records in LMDB)")
    try:
        return _conversation(args, mode, data_dir, overrides)
    finally:
        if redis is not None:
            redis.stop()


def _conversation(args, mode: str, data_dir: str, overrides: dict) -> dict:
    rig = Rig(data_dir, **overrides)
    store = rig.store
    cpu: list[float] = []
    meter = None
    if store is not None:  # the writer thread's CPU time per commit
        store.add_commit_listener(lambda c: cpu.append(c.cpu_s) if c.background else None)
        meter = TierBytes(store, rig.serving.store.records, overrides.get("redis_url", ""))
    rig.open_session("conv", "You are a helpful assistant.")
    ratios, all_ratios, ttfts, saved_tokens = [], [], [], 0
    written = 0
    per_token = store.bytes_per_token if store is not None else 0
    per_turn: dict[str, list[int]] = {"written": [], "new": [], "history": []}  # bytes
    chunks_before: set = set()
    for t in progress.track(range(args.turns), f"conversation, store {mode}"):
        before = meter.snapshot() if meter is not None else None
        res = rig.session_turn("conv", words(t * 150, args.words), args.reply_tokens)
        ttfts.append(res.ttft_s)
        if store is not None and meter is not None and before is not None:
            # The turn's writes land in the turn: the writer's commit, then the write-back
            # of the chunks it stored (to LMDB and, with Redis, to Redis), due now.
            store.flush_writes(60)
            store.flush_persist(60)
            tiers = meter.delta(before, meter.snapshot(end=True))
            now = res.prompt_tokens + len(res.reply) - 1
            new = max(1, now - min(saved_tokens, res.cached_tokens))
            ratios.append((store.bytes_written - written) / (new * per_token))
            all_ratios.append(tiers["all_tiers"] / (new * per_token))
            per_turn["written"].append(store.bytes_written - written)
            per_turn["new"].append(new * per_token)
            per_turn["history"].append(now * per_token)
            stored = store.find(TENANT, "conv")
            fresh = [i for i, c in enumerate(stored.chunks) if c not in chunks_before]
            tiers["new_chunks_kv"] = per_token * sum(
                b - a for a, b in map(stored.span, fresh)
            )  # the KV of the chunks this turn created: what write-back copies
            chunks_before = set(stored.chunks)
            for name, value in tiers.items():
                per_turn.setdefault(name, []).append(value)
            written, saved_tokens = store.bytes_written, now
        if t % 10 == 9:
            say(
                f"  {mode}: turn {t + 1}, {res.prompt_tokens} prompt tokens, "
                f"TTFT {res.ttft_s:.3f} s"
            )
    out = {"ttft_last5_s": statistics.mean(ttfts[-5:]), "history_tokens": saved_tokens}
    out |= {"ttft_by_turn_s": ttfts, "bytes_by_turn": per_turn}
    if store is not None and meter is not None:
        store.flush_persist(60)
        worst = 1 + max(range(1, len(all_ratios)), key=all_ratios.__getitem__)
        out |= {
            "bytes_written_ratio_max": max(ratios[1:]),
            "bytes_written_ratio_mean": statistics.mean(ratios[1:]),
            "bytes_written_ratio_max_all_tiers": max(all_ratios[1:]),
            "bytes_written_ratio_mean_all_tiers": statistics.mean(all_ratios[1:]),
            "bytes_all_tiers_max_turn": {"turn": worst}
            | {name: values[worst - 1] for name, values in per_turn.items()},
            "tiers": [t.name for t in store.tiers.tiers],
            "records_backend": meter.records_backend,
            "save_cpu_ms_turn5": 1000 * cpu[4],
            "save_cpu_ms_turn40": 1000 * cpu[min(39, len(cpu) - 1)],
            "session_kv_bytes": saved_tokens * per_token,
        }
        meter.close()
    rig.close()
    size = sum(f.stat().st_size for f in Path(data_dir, "kv.lmdb").glob("*")) if store else 0
    out["kv_lmdb_bytes"] = size
    return out


# -- store overhead with room on the device ----------------------------------------------------


def overhead(args, kv_store: str, data_dir: str) -> float:
    rig = Rig(data_dir, kv_store=kv_store, **args.store_overrides)
    sessions = {f"o{i}": [{"role": "system", "content": "Answer briefly."}] for i in range(6)}
    later = []
    bar = progress.progress_bar(args.overhead_turns * len(sessions), f"overhead, store {kv_store}")
    with bar as turns_done:
        for t in range(args.overhead_turns):
            for i, (sid, messages) in enumerate(sessions.items()):
                messages.append({"role": "user", "content": words(1000 * i + 200 * t, 180)})
                res = rig.turn(sid, messages, 16)
                messages.append({"role": "assistant", "content": rig.tok.decode(res.reply)})
                turns_done.update(1)
                if t:
                    later.append(res.ttft_s)
    rig.close()
    return statistics.mean(later)


# -- shared system prompt ------------------------------------------------------------------------


def dedup(args, data_dir: str) -> dict:
    rig = Rig(data_dir)
    system = words(5000, 700)  # ~1K tokens once rendered
    rendered = rig.tok.apply_chat_template(
        [{"role": "system", "content": system}], tokenize=True, return_dict=True
    )
    prompt_tokens = len(rendered["input_ids"])
    own = 0
    for i in progress.track(range(args.dedup_sessions), "shared prefix sessions"):
        messages = [{"role": "system", "content": system}]
        for t in range(2):
            messages.append({"role": "user", "content": words(300 * i + 60 * t, 60)})
            res = rig.turn(f"d{i}", messages, 8)
            messages.append({"role": "assistant", "content": rig.tok.decode(res.reply)})
        own += res.prompt_tokens + len(res.reply) - 1 - prompt_tokens
    store = rig.store
    store.flush_writes(60)
    # DRAM holds every chunk once (SSD holds write-back copies of the same chunks).
    stored = store.tier("dram").used_bytes()
    ideal = (prompt_tokens + own) * store.bytes_per_token
    chunks = len(store.tiers.keys())
    copies = 32 * (prompt_tokens + own / args.dedup_sessions) * store.bytes_per_token
    rig.close()
    return {
        "dedup_ratio": stored / ideal,
        "per_session_copies_ratio": copies / ideal,  # what one value per session would take
        "system_prompt_tokens": prompt_tokens,
        "own_tokens": own,
        "chunks": chunks,
    }


# -- device pool under pressure ------------------------------------------------------------------


def pressure(args, kv_store: str, data_dir: str) -> float:
    """Each session opens with a ~400-token message (a pasted text and a question), then asks
    short follow-ups: 32 such histories are ~4x the device pool."""
    spec_bytes = 2 * 30 * 3 * 64 * 4  # fp32 KV bytes per token of the default model
    rig = Rig(data_dir, kv_store=kv_store, kv_cache_bytes=4096 * spec_bytes)
    sessions = {f"p{i}": [{"role": "system", "content": "Answer briefly."}] for i in range(32)}
    later = []
    for t in range(args.pressure_turns):
        for i, (sid, messages) in enumerate(
            progress.track(sessions.items(), f"pressure round {t + 1}")
        ):
            n = 300 if t == 0 else 40
            messages.append({"role": "user", "content": words(700 * i + 300 * t, n)})
            res = rig.turn(sid, messages, 8)
            messages.append({"role": "assistant", "content": rig.tok.decode(res.reply)})
            if t:
                later.append(res.ttft_s)
        say(f"  pressure {kv_store}: round {t + 1} done")
    rig.close()
    return statistics.mean(later)


# -- kill -9 and restart ---------------------------------------------------------------------------

CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from bench.store_io import Rig, words
rig = Rig({data_dir!r}, persist_lag_s=0.5)
for i in range({n}):
    ids = rig.tok.encode(words(400 * i, {words}))
    rig.turn_ids(f"w{{i}}", ids, 8)
    print("turn", i, len(ids), flush=True)
time.sleep(2.0)  # > persist_lag_s: every chunk has reached LMDB
print("ready", flush=True)
time.sleep(600)
"""


def restart(args, data_dir: str) -> dict:
    n = args.restart_sessions
    code = CHILD.format(root=str(ROOT), data_dir=data_dir, n=n, words=args.restart_words)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("ready"):
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    rig = Rig(data_dir)
    tok = rig.tok
    warm, ttfts = 0, []
    for i in range(n):
        history = tok.encode(words(400 * i, args.restart_words))
        saved = (
            len(rig.store.find("local", f"w{i}").token_ids)
            if rig.store.find("local", f"w{i}")
            else 0
        )
        res = rig.turn_ids(f"w{i}", history + tok.encode(" And then?"), 8)
        warm += res.cached_tokens >= len(history) - 16 and saved > 0
        ttfts.append(res.ttft_s)
    rig.close()
    cold = Rig(tempfile.mkdtemp(dir=data_dir), kv_store="off", enable_prefix_cache=False)
    colds = []
    for i in range(n):
        history = tok.encode(words(400 * i, args.restart_words))
        colds.append(cold.turn_ids(f"c{i}", history + tok.encode(" And then?"), 8).ttft_s)
    cold.close()
    return {
        "warm_restart_share": warm / n,
        "warm_restart_ttft_ratio": statistics.mean(ttfts) / statistics.mean(colds),
        "restart_ttft_s": statistics.mean(ttfts),
        "cold_ttft_s": statistics.mean(colds),
        "history_tokens": len(tok.encode(words(0, args.restart_words))),
    }


def say_checks(per_turn: dict[str, list[int]]) -> None:
    """Plausibility of the DRAM run's byte counts, over turns 2..n."""
    chunks = per_turn["new_chunks_kv"][1:]
    for name in ("lmdb_kv", "redis_kv"):
        if any(per_turn[name]):
            low = min(b / c for b, c in zip(per_turn[name][1:], chunks, strict=True) if c)
            say(f"  check: {name} / the KV of the turn's new chunks, min over turns {low:.3f}")
    if "redis_in" in per_turn:
        sent, got = sum(per_turn["redis_sent"]), sum(per_turn["redis_in"])
        say(f"  check: Redis bytes sent {sent}, received by the server {got} (all turns)")


def plot_conversation(plot_dir: Path, runs: dict[str, dict]) -> list[Path]:
    """Bytes the DRAM run wrote per turn (the store's counter, every tier), and TTFT per turn
    of every run."""
    mb = 1e6
    turns = range(1, len(runs["dram"]["ttft_by_turn_s"]) + 1)
    per_turn = runs["dram"]["bytes_by_turn"]
    written = plots.line_chart(
        plots.plot_path(plot_dir, "store_io", "bytes_per_turn"),
        [
            plots.Series(
                "store's own counter: chunk bytes into the tiers (measured)",
                turns,
                [b / mb for b in per_turn["written"]],
            ),
            plots.Series(
                f"all tiers: {' + '.join(runs['dram']['tiers'])} + records (measured)",
                turns,
                [b / mb for b in per_turn["all_tiers"]],
            ),
            plots.Series(
                "the new tokens' KV (computed)",
                turns,
                [b / mb for b in per_turn["new"]],
                dashed=True,
            ),
            plots.Series(
                "rewrite everything: the whole history's KV (computed)",
                turns,
                [b / mb for b in per_turn["history"]],
                dashed=True,
            ),
        ],
        title="store_io: bytes written per turn, one growing conversation (DRAM run)",
        xlabel="turn",
        ylabel="MB written in the turn",
        integer_x=True,
    )
    names = {
        "off": "store off (device prefix cache)",
        "dram": "DRAM tier",
        "lmdb": "LMDB tier alone",
    }
    ttft = plots.line_chart(
        plots.plot_path(plot_dir, "store_io", "ttft_by_turn"),
        [plots.Series(names[m], turns, r["ttft_by_turn_s"]) for m, r in runs.items()],
        title="store_io: time to first token by turn, one growing conversation",
        xlabel="turn",
        ylabel="TTFT, s",
        integer_x=True,
    )
    return [written, ttft]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS))
    p.add_argument("--quick", action="store_true", help="short runs (a smoke test)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        help="store setting for the overhead runs, e.g. --set persist=off (what it costs)",
    )
    p.add_argument(
        "--redis",
        choices=("auto", "on", "off"),
        default="auto",
        help="a local Redis tier in the conversation's DRAM run (auto: when redis-server exists)",
    )
    plots.add_argument(p)
    progress.add_argument(p)
    args = p.parse_args()
    progress.configure(args)
    args.store_overrides = dict(kv.split("=", 1) for kv in args.set)
    args.turns, args.words, args.reply_tokens = (8, 60, 8) if args.quick else (40, 125, 24)
    args.overhead_turns = 2 if args.quick else 5
    args.dedup_sessions = 4 if args.quick else 32
    args.pressure_turns = 2 if args.quick else 4
    args.restart_sessions, args.restart_words = (2, 300) if args.quick else (6, 2900)
    only = set(args.only.split(","))
    result: dict = {"bench": "store_io"}
    with tempfile.TemporaryDirectory() as tmp:

        def fresh() -> str:
            return tempfile.mkdtemp(dir=tmp)

        if "conversation" in only:
            runs = {m: conversation(args, m, fresh()) for m in ("off", "dram", "lmdb")}
            off, dram, lmdb = runs["off"], runs["dram"], runs["lmdb"]
            say(
                f"conversation: {dram['history_tokens']} tokens of history after {args.turns} turns"
            )
            say(
                f"  TTFT of the last five turns: off {off['ttft_last5_s']:.3f} s, DRAM "
                f"{dram['ttft_last5_s']:.3f} s, LMDB alone {lmdb['ttft_last5_s']:.3f} s"
            )
            say(
                "  bytes written / new tokens' KV bytes: max "
                f"{dram['bytes_written_ratio_max']:.3f}, "
                f"mean {dram['bytes_written_ratio_mean']:.3f}; save CPU turn 5 "
                f"{dram['save_cpu_ms_turn5']:.1f} ms, turn {args.turns} "
                f"{dram['save_cpu_ms_turn40']:.1f} ms"
            )
            worst = dram["bytes_all_tiers_max_turn"]
            say(
                f"  all tiers ({'+'.join(dram['tiers'])}, records in {dram['records_backend']}) "
                f"/ new tokens' KV bytes: max {dram['bytes_written_ratio_max_all_tiers']:.3f}, "
                f"mean {dram['bytes_written_ratio_mean_all_tiers']:.3f} (goal <= 1.5)"
            )
            say(
                f"  turn {worst['turn']} (the max), bytes: new tokens' KV {worst['new']}, "
                f"DRAM {worst['dram']}, LMDB KV {worst['lmdb_kv']}, Redis KV {worst['redis_kv']}, "
                f"records {worst['records']}, other {worst['other']} "
                f"(Redis received {worst.get('redis_in', '-')}; "
                f"the turn's new chunks hold {worst['new_chunks_kv']} bytes of KV)"
            )
            say_checks(dram["bytes_by_turn"])
            say(
                f"  LMDB-alone run ({'+'.join(lmdb['tiers'])}, records in "
                f"{lmdb['records_backend']}): all tiers / new tokens' KV bytes: max "
                f"{lmdb['bytes_written_ratio_max_all_tiers']:.3f}, "
                f"mean {lmdb['bytes_written_ratio_mean_all_tiers']:.3f}"
            )
            plot_conversation(args.plot_dir, runs)
            result |= {
                "bytes_written_ratio_max": round(dram["bytes_written_ratio_max"], 3),
                "bytes_written_ratio_mean": round(dram["bytes_written_ratio_mean"], 3),
                "bytes_written_ratio_max_all_tiers": round(
                    dram["bytes_written_ratio_max_all_tiers"], 3
                ),
                "bytes_written_ratio_mean_all_tiers": round(
                    dram["bytes_written_ratio_mean_all_tiers"], 3
                ),
                "bytes_all_tiers_max_turn": dram["bytes_all_tiers_max_turn"],
                "conversation_tiers": dram["tiers"],
                "records_backend": dram["records_backend"],
                "save_cpu_ms_turn5": round(dram["save_cpu_ms_turn5"], 2),
                "save_cpu_ms_turn40": round(dram["save_cpu_ms_turn40"], 2),
                "dram_ttft_ratio": round(dram["ttft_last5_s"] / off["ttft_last5_s"], 3),
                "lmdb_ttft_ratio": round(lmdb["ttft_last5_s"] / off["ttft_last5_s"], 3),
                "data_dir_ratio": round(lmdb["kv_lmdb_bytes"] / lmdb["session_kv_bytes"], 3),
                "conversation_tokens": dram["history_tokens"],
            }
        if "overhead" in only:
            times = {"on": [], "off": []}
            for mode in ("on", "off", "off", "on"):
                times[mode].append(overhead(args, mode, fresh()))
            on, off = statistics.mean(times["on"]), statistics.mean(times["off"])
            say(f"overhead: later-turn TTFT store on {on:.3f} s, off {off:.3f} s")
            result["store_overhead_ratio"] = round(on / off, 3)
        if "dedup" in only:
            d = dedup(args, fresh())
            say(f"shared prefix: {d}")
            result["dedup_ratio"] = round(d["dedup_ratio"], 3)
        if "pressure" in only:
            on, off = pressure(args, "on", fresh()), pressure(args, "off", fresh())
            say(f"pressure: later-turn TTFT store on {on:.3f} s, off {off:.3f} s")
            result["pressure_ttft_ratio"] = round(on / off, 3)
        if "restart" in only:
            r = restart(args, fresh())
            say(f"warm restart: {r}")
            result["warm_restart_ttft_ratio"] = round(r["warm_restart_ttft_ratio"], 3)
            result["warm_restart_share"] = round(r["warm_restart_share"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
