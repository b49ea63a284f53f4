"""Replicas: the topology of deploy/cluster.sh (2 replicas, nginx, a 3-master Redis Cluster, all
on loopback; tests/support/replicas.py), measured.

  routing    a multi-turn workload through nginx, once hashed on the session (affine) and
             once round-robin, on the same replicas in the same run; sessions take turns
             one at a time (2 cores: concurrency would only measure the CPU)
               affine_hit_share / round_robin_hit_share
                 share of later turns whose whole history came from the device or DRAM of
                 the replica that served them: cached_tokens >= the previous turn's prompt
                 and the same replica as the previous turn (the KV is where that turn left
                 it); a history hit on another replica could only come from Redis, counted
                 apart (*_remote_hit_share); /admin/cache tier hits are reported per phase
  migration  kill -9 of one replica after the affine phase; each of its sessions' next turn
             through the proxy lands on the survivor
               migration_ttft_ms           the survivor's TTFT (client-side, SSE, via nginx)
               recompute_ttft_ms           the same history and message on a kv_store = off
                                           server (the whole history prefilled)
               migration_ttft_ratio        migration / recompute (< 1: KV reused from Redis)
               lost_turns                  acknowledged turns missing from, or changed in,
                                           the sessions' histories afterwards
  redis      pipelined SET / GET of whole chunks of the default model's KV (256 tokens ×
             30 layers × K,V × 3 heads × 64 × fp32 = 11.8 MB) through the Redis Cluster and
             through one redis-server, same client code, same run
               cluster_put_gbps / cluster_get_gbps / single_put_gbps / single_get_gbps

    python bench/replicas.py [--quick] [--no-progress]

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import progress  # noqa: E402
from chatstore.store.tiers.redis import connect_redis  # noqa: E402
from tests.chaos.clients import sse_events  # noqa: E402
from tests.chaos.harness import ServerProcess, http_client  # noqa: E402
from tests.support.redis_server import start_local_redis  # noqa: E402
from tests.support.replicas import AFFINE, ROUND_ROBIN, ReplicaCluster  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer in two sentences."
TOPICS = ["rivers", "volcanoes", "bridges", "comets", "forests", "deserts", "glaciers", "islands"]
TURNS = [
    "Tell me about {}.",
    "Why does that matter?",
    "Give an example.",
    "Say more.",
    "Summarise.",
]
GREEDY = {"temperature": 0, "max_tokens": 24}
FINAL = "One last thing: what should I read next?"
CHUNK_BYTES = 256 * 30 * 2 * 3 * 64 * 4


@dataclass
class Turn:
    sid: str
    content: str
    reply: str
    replica: str  # the upstream that served it (after a failover, the last one)
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Phase:
    turns: list[Turn] = field(default_factory=list)
    tier_hits: dict[str, int] = field(default_factory=dict)

    def later(self) -> list[tuple[Turn, Turn]]:
        by_sid: dict[str, list[Turn]] = {}
        for t in self.turns:
            by_sid.setdefault(t.sid, []).append(t)
        return [(a, b) for ts in by_sid.values() for a, b in itertools.pairwise(ts)]

    def share(self, same_replica: bool) -> float:
        pairs = self.later()
        hits = [
            b
            for a, b in pairs
            if b.cached_tokens >= a.prompt_tokens and (a.replica == b.replica) == same_replica
        ]
        return len(hits) / len(pairs) if pairs else 0.0


def tier_hits(cluster: ReplicaCluster) -> dict[str, int]:
    totals: dict[str, int] = {}
    for replica in cluster.replicas:
        if not replica.alive():
            continue
        with replica.client(10.0) as http:
            body = http.get("/admin/cache").json()
        for tier in body["tiers"]:
            totals[tier["name"]] = totals.get(tier["name"], 0) + tier["hits"]
        totals["prefix"] = totals.get("prefix", 0) + body["engine"]["prefix_hits"]
    return totals


def post(http: Any, sid: str, content: str) -> tuple[dict[str, Any], str]:
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": content, **GREEDY})
    r.raise_for_status()
    return r.json(), r.headers.get("x-upstream", "").split(",")[-1].strip()


def workload(cluster: ReplicaCluster, url: str, name: str, sessions: int, turns: int) -> Phase:
    phase = Phase()
    before = tier_hits(cluster)
    sids = [f"{name}-{i}" for i in range(sessions)]
    with http_client(url, 120.0) as http:
        for sid in sids:
            # The id in the system prompt keeps histories apart: the phases ask the same
            # questions greedily, and a replica's prefix cache would otherwise serve one
            # phase's history to the other (a false hit, above all for migrated sessions).
            body = {"id": sid, "system_prompt": f"{SYSTEM} Conversation {sid}."}
            http.post("/v1/sessions", json=body).raise_for_status()
        # A fresh order every round (the same in both phases): in a fixed order with an even
        # number of sessions, round-robin would send each session to the same replica anyway.
        rng = random.Random(7)
        order = [(k, i) for k in range(turns) for i in rng.sample(range(sessions), sessions)]
        for k, i in progress.track(order, f"{name} turns"):
            sid = sids[i]
            content = TURNS[k % len(TURNS)].format(TOPICS[i % len(TOPICS)])
            body, upstream = post(http, sid, content)
            usage = body["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            reply = body["message"]["content"]
            phase.turns.append(Turn(sid, content, reply, upstream, usage["prompt_tokens"], cached))
    after = tier_hits(cluster)
    phase.tier_hits = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return phase


def streamed(http: Any, path: str, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """(seconds to the first token's text, the reply, the last event): the same client-side
    clock for a session turn and an OpenAI completion, so the two TTFTs compare."""
    t0 = time.perf_counter()
    ttft, text, last = None, [], {}
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        response.raise_for_status()
        for event in sse_events(response.iter_lines()):
            piece = event.get("text") or "".join(
                (c.get("delta") or {}).get("content") or "" for c in event.get("choices", [])
            )
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(piece)
            last = event
    return ttft or time.perf_counter() - t0, "".join(text), last


def migrate(cluster: ReplicaCluster, phase: Phase, work: Path) -> dict[str, Any]:
    """kill -9 the replica that served the most sessions; each of them takes one more turn."""
    last: dict[str, Turn] = {t.sid: t for t in phase.turns}
    counts: dict[str, int] = {}
    for t in last.values():
        counts[t.replica] = counts.get(t.replica, 0) + 1
    victim_addr = max(counts, key=counts.__getitem__)
    victim = cluster.replica_at(victim_addr)
    moved = [sid for sid, t in last.items() if t.replica == victim_addr]
    histories: dict[str, list[dict[str, str]]] = {}
    with cluster.client(120.0) as http:
        for sid in moved:
            messages = http.get(f"/v1/sessions/{sid}").json()["messages"]
            histories[sid] = [{"role": m["role"], "content": m["content"]} for m in messages]
        victim.kill9()
        before = tier_hits(cluster)
        migrated = []
        for sid in moved:
            body = {"content": FINAL, **GREEDY}
            ttft, reply, done = streamed(http, f"/v1/sessions/{sid}/messages", body)
            migrated.append((ttft, reply, done["usage"]["prompt_tokens_details"]["cached_tokens"]))
            phase.turns.append(Turn(sid, FINAL, reply, "", 0, 0))
        stored = {sid: http.get(f"/v1/sessions/{sid}").json()["messages"] for sid in last}
    after = tier_hits(cluster)
    recompute = ServerProcess(work / "recompute", {"CHATSTORE_KV_STORE": "off"}).start()
    try:
        with recompute.client(120.0) as http:
            reference = []
            for sid in moved:
                messages = [*histories[sid], {"role": "user", "content": FINAL}]
                body = {"messages": messages, **GREEDY}
                reference.append(streamed(http, "/v1/chat/completions", body))
    finally:
        recompute.stop()
    mig = statistics.median(m[0] for m in migrated) * 1000
    ref = statistics.median(r[0] for r in reference) * 1000
    same = sum(m[1] == r[1] for m, r in zip(migrated, reference, strict=True))
    return {
        "migrated_sessions": len(moved),
        "migrated_cached_tokens": statistics.median(m[2] for m in migrated),
        "migration_tier_hits": {k: v - before.get(k, 0) for k, v in after.items()},
        "migration_ttft_ms": round(mig, 1),
        "recompute_ttft_ms": round(ref, 1),
        "migration_ttft_ratio": round(mig / ref, 3) if ref else None,
        "migrated_replies_equal_recompute": f"{same}/{len(moved)}",
        "lost_turns": lost_turns(phase, stored),
    }


def lost_turns(phase: Phase, stored: dict[str, list[dict[str, Any]]]) -> int:
    """Acknowledged turns not found, in order and with the reply seen, in the stored history."""
    lost = 0
    for sid, messages in stored.items():
        kept = [(m["role"], m["content"]) for m in messages if m["role"] != "system"]
        pairs = list(zip(kept[::2], kept[1::2], strict=False))
        j = 0
        for t in (t for t in phase.turns if t.sid == sid):
            want = (("user", t.content), ("assistant", t.reply))
            found = next((k for k in range(j, len(pairs)) if pairs[k] == want), None)
            if found is None:
                lost += 1
            else:
                j = found + 1
    return lost


def throughput(url: str, chunks: int) -> tuple[float, float]:
    """(put, get) GB/s of `chunks` whole chunks, one pipeline each way."""
    client = connect_redis(url, 60.0)
    payload = os.urandom(CHUNK_BYTES)
    keys = [f"bench:replicas:{i}" for i in range(chunks)]
    total = CHUNK_BYTES * chunks / 1e9
    try:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, payload)
        t0 = time.perf_counter()
        pipe.execute()
        put = total / (time.perf_counter() - t0)
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        t0 = time.perf_counter()
        got = pipe.execute()
        get = total / (time.perf_counter() - t0)
        assert all(len(v) == CHUNK_BYTES for v in got)
        for key in keys:  # one key per call: cluster keys live in different slots
            client.delete(key)
    finally:
        client.close()
    return round(put, 3), round(get, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 sessions × 4 turns, 16 chunks")
    progress.add_argument(parser)
    args = parser.parse_args()
    progress.configure(args)
    sessions, turns, chunks = (4, 4, 16) if args.quick else (12, 5, 64)
    t0 = time.monotonic()
    out: dict[str, Any] = {"sessions": sessions, "turns": turns}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        work = Path(tmp)
        cluster = ReplicaCluster(work, replicas=2, balances=(AFFINE, ROUND_ROBIN)).start()
        try:
            affine = workload(cluster, cluster.proxies[0].url, "aff", sessions, turns)
            rr = workload(cluster, cluster.proxies[1].url, "rr", sessions, turns)
            out["affine_hit_share"] = round(affine.share(True), 3)
            out["affine_remote_hit_share"] = round(affine.share(False), 3)
            out["round_robin_hit_share"] = round(rr.share(True), 3)
            out["round_robin_remote_hit_share"] = round(rr.share(False), 3)
            out["affine_tier_hits"] = affine.tier_hits
            out["round_robin_tier_hits"] = rr.tier_hits
            out.update(migrate(cluster, affine, work))
            put, get = throughput(cluster.redis.url, chunks)
            out["cluster_put_gbps"], out["cluster_get_gbps"] = put, get
        finally:
            cluster.stop()
        single = start_local_redis()
        try:
            put, get = throughput(single.url, chunks)
            out["single_put_gbps"], out["single_get_gbps"] = put, get
        finally:
            single.stop()
    out["chunk_mb"] = round(CHUNK_BYTES / 1e6, 2)
    out["chunks"] = chunks
    out["seconds"] = round(time.monotonic() - t0, 1)
    for key, value in out.items():
        print(f"{key:34s} {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
