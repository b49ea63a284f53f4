"""Two replicas behind nginx on a Redis Cluster, real processes on loopback
(tests/support/replicas.py, the topology of deploy/cluster.sh):

(a) a session begun through the proxy stays on one replica and hits its device/DRAM KV;
(b) two replicas posting to one session at once: the session lease lets one through (409);
(c) kill -9 of a replica: the next turn goes to the other, reuses the KV held in Redis,
    says what a recompute server says, and no acknowledged turn is lost. Last, as its victim
    stays dead (a restart only for a test after it would cost a model load).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from tests.chaos.harness import ServerProcess, http_client
from tests.support.replicas import ReplicaCluster

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(180)]

GREEDY = {"temperature": 0, "max_tokens": 24}
SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTIONS = ["Name a planet.", "Name another one.", "Which of the two is bigger?"]
FINAL = "And which is closer to the Sun?"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ReplicaCluster(tmp_path_factory.mktemp("replicas"), replicas=2).start() as running:
        yield running


def new_session(http: httpx.Client) -> str:
    sid = f"sess-{uuid.uuid4().hex[:12]}"
    # The header routes the create too, so the whole session lives on one replica. The id in
    # the system prompt makes every history unique: greedy replies to the same questions would
    # otherwise give another session's identical history, found by the prefix cache of a
    # replica, passing for a cross-replica reuse of this session's KV.
    body = {"id": sid, "system_prompt": f"{SYSTEM} Conversation {sid}."}
    response = http.post("/v1/sessions", json=body, headers={"X-Session-ID": sid})
    assert response.status_code in (200, 201), response.text
    return sid


def turn(http: httpx.Client, sid: str, content: str, **extra: Any) -> httpx.Response:
    body = {"content": content, **GREEDY, **extra}
    return http.post(f"/v1/sessions/{sid}/messages", json=body)


def cached(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def prompt(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens"]


def history_reused(before: httpx.Response, now: httpx.Response) -> bool:
    """The turn found the KV of (at least) the history up to the previous turn's prompt."""
    return cached(now) >= prompt(before)


def local_hits(replica: ServerProcess) -> int:
    with replica.client(10.0) as http:
        tiers = http.get("/admin/cache").json()["tiers"]
    return sum(t["hits"] for t in tiers if t["name"] in ("device", "dram"))


def converse(cluster: ReplicaCluster, http: httpx.Client) -> tuple[str, list[httpx.Response]]:
    sid = new_session(http)
    responses = [turn(http, sid, q) for q in QUESTIONS]
    for r in responses:
        assert r.status_code == 200, r.text
    return sid, responses


def test_session_sticks_to_one_replica_and_hits_its_memory(cluster):
    with cluster.client() as http:
        _, responses = converse(cluster, http)
    served = {cluster.replica_at(r.headers["x-upstream"]).port for r in responses}
    assert len(served) == 1, f"one session went to several replicas: {served}"
    replica = cluster.replica_at(responses[0].headers["x-upstream"])
    assert all(history_reused(a, b) for a, b in itertools.pairwise(responses)), [
        (prompt(r), cached(r)) for r in responses
    ]
    assert local_hits(replica) > 0, "later turns did not hit the replica's device/DRAM tiers"


def race(replicas: list[ServerProcess], sid: str, body: dict[str, Any]) -> list[int]:
    """The same turn posted to every replica at once; the sorted status codes."""
    barrier = threading.Barrier(len(replicas))
    codes: list[int] = []

    def post(replica: ServerProcess) -> None:
        with http_client(replica.url, 120.0) as http:
            barrier.wait()
            try:
                codes.append(http.post(f"/v1/sessions/{sid}/messages", json=body).status_code)
            except httpx.HTTPError:
                codes.append(0)  # a timeout: shows in the assertion, not as a lost code

    threads = [threading.Thread(target=post, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    return sorted(codes)


def test_concurrent_turns_on_two_replicas_get_409(cluster):
    for replica in cluster.replicas:  # both up: the kill -9 test below leaves one dead
        if not replica.alive():
            replica.start()
    with cluster.client() as http:
        sid = new_session(http)
    long_turn = {"content": "Write a long story about a lighthouse.", "max_tokens": 32}
    rounds = [race(cluster.replicas, sid, {**long_turn, "temperature": 0}) for _ in range(3)]
    assert rounds == [[200, 409]] * 3, f"expected one turn through and one 409 each: {rounds}"
    with cluster.client() as http:
        messages = http.get(f"/v1/sessions/{sid}").json()["messages"]
    assert sum(m["role"] == "user" for m in messages) == 3, "a refused turn was kept"


def test_killed_replica_sessions_continue_elsewhere_from_redis(cluster, tmp_path):
    # The recompute reference: kv_store = off, no Redis, fed the same history through the
    # OpenAI route. The session's record lives in Redis, which a kv_store = off server
    # cannot read (its records are LMDB only), so it gets the messages instead.
    recompute = ServerProcess(tmp_path / "recompute", {"CHATSTORE_KV_STORE": "off"}).start()
    try:
        with cluster.client() as http:
            sid, responses = converse(cluster, http)
            victim = cluster.replica_at(responses[-1].headers["x-upstream"])
            acked = [
                (q, r.json()["message"]["content"])
                for q, r in zip(QUESTIONS, responses, strict=True)
            ]
            history = http.get(f"/v1/sessions/{sid}").json()["messages"]
            # Write-back: a stored chunk reaches Redis within persist_lag_s (0.2 s here) of
            # an idle moment; a crash sooner loses only the newest chunks (recomputed).
            time.sleep(1.5)
            victim.kill9()
            after = turn(http, sid, FINAL)
            assert after.status_code == 200, after.text
            survivor = cluster.replica_at(after.headers["x-upstream"])
            assert survivor.port != victim.port
            kept = http.get(f"/v1/sessions/{sid}").json()["messages"]
        with recompute.client() as http:
            messages = [{"role": m["role"], "content": m["content"]} for m in history]
            body = {"messages": [*messages, {"role": "user", "content": FINAL}], **GREEDY}
            reference = http.post("/v1/chat/completions", json=body).json()
    finally:
        recompute.stop()  # the victim stays dead: this test is the module's last
    assert after.json()["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    assert after.json()["message"]["content"] == reference["choices"][0]["message"]["content"]
    turns = [(m["role"], m["content"]) for m in kept if m["role"] != "system"]
    expected = [pair for q, a in acked for pair in (("user", q), ("assistant", a))]
    assert turns[: len(expected)] == expected, "an acknowledged turn was lost or changed"
    assert turns[len(expected)] == ("user", FINAL)
    # Last, so that a missing cross-replica reuse does not hide the checks above. The bar is
    # the history before the last turn: a few cached tokens come from any replica's prefix
    # cache (the chat template and the system prompt's start are shared by every session).
    assert history_reused(responses[-1], after), (
        f"the survivor recomputed instead of reusing Redis's KV: {cached(after)} cached "
        f"tokens of {prompt(after)}, history before the last turn {prompt(responses[-1])}"
    )
