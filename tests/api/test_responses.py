"""The Responses API, driven by the official `openai` client against a real server (real
default model, engine and session store) on a loopback port, with two tenants."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from chatstore.api.common.settings import ServerSettings
from chatstore.server.launcher import local_server

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

ALICE, BOB, ADMIN = "key-alice", "key-bob", "key-admin"
GREEDY = {"model": "default", "temperature": 0, "max_output_tokens": 8}
INSTRUCTIONS = "Answer in one short sentence."
STORE = {"kv_cache_bytes": 48 << 20, "dram_bytes": 256 << 20}
OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def settings() -> ServerSettings:
    return ServerSettings(api_keys={ALICE: "alice", BOB: "bob"}, admin_key=ADMIN)


def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("api-responses")
    with local_server(data, default_model, settings(), **STORE) as srv:
        yield srv


@pytest.fixture(scope="module")
def alice(server):
    with sdk(server.url, ALICE) as c:
        yield c


@pytest.fixture(scope="module")
def bob(server):
    with sdk(server.url, BOB) as c:
        yield c


@pytest.fixture(scope="module")
def alice_http(server):
    headers = {"Authorization": f"Bearer {ALICE}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
        yield c


def extra(response, name: str):
    """A chatstore extension field of a response object (the SDK keeps unknown fields)."""
    return response.to_dict()[name]


def chat_reply(client: openai.OpenAI, messages: list[dict]) -> str:
    out = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=GREEDY["max_output_tokens"]
    )
    return out.choices[0].message.content


def history(*turns: tuple[str, str]) -> list[dict]:
    """The chat messages of a conversation of (user, assistant) turns, with INSTRUCTIONS."""
    messages = [{"role": "system", "content": INSTRUCTIONS}]
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages


def stream_events(client: openai.OpenAI, **kw) -> list:
    with client.responses.create(stream=True, **kw) as stream:
        return list(stream)


def check_stream(events: list):
    """The event order OpenAI's clients expect; the finished response."""
    types = [e.type for e in events]
    assert types[:4] == OPENING
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas) :] in (
        [*CLOSING, "response.completed"],
        [*CLOSING, "response.incomplete"],
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    text = "".join(d.delta for d in deltas)
    assert text == events[-4].text == final.output_text
    assert events[-2].item.content[0].text == text
    assert {d.item_id for d in deltas} == {events[2].item.id} == {final.output[0].id}
    return final


def test_chain_reuses_the_kv_and_matches_chat_completions(alice):
    q1, q2 = "What is the capital of France?", "And of Italy?"
    first = alice.responses.create(input=q1, instructions=INSTRUCTIONS, **GREEDY)
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.instructions == INSTRUCTIONS and first.max_output_tokens == 8
    assert first.temperature == 0 and first.previous_response_id is None
    usage = first.usage
    assert usage.input_tokens > 0 and 1 <= usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    tiers = usage.to_dict()["cached_tokens_by_tier"]
    assert set(tiers) == {"device", "dram", "ssd", "remote"}
    assert sum(tiers.values()) <= usage.input_tokens_details.cached_tokens

    second = alice.responses.create(
        input=q2, instructions=INSTRUCTIONS, previous_response_id=first.id, **GREEDY
    )
    assert second.previous_response_id == first.id
    assert extra(second, "session_id") == extra(first, "session_id")  # one chain, one session
    # The whole first turn's prompt came from the session's stored KV.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens
    # The same conversation through Chat Completions: the same greedy reply.
    messages = [*history((q1, first.output_text)), {"role": "user", "content": q2}]
    assert second.output_text == chat_reply(alice, messages)


def test_stream_chain_event_order_and_cached_tokens(alice):
    q1, q2 = "Name a color of the sky.", "Name another one."
    first = check_stream(stream_events(alice, input=q1, instructions=INSTRUCTIONS, **GREEDY))
    assert first.usage.output_tokens >= 1
    events = stream_events(
        alice, input=q2, instructions=INSTRUCTIONS, previous_response_id=first.id, **GREEDY
    )
    second = check_stream(events)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    messages = [*history((q1, first.output_text)), {"role": "user", "content": q2}]
    assert second.output_text == chat_reply(alice, messages)
    # Streamed or not, a stored response reads back the same.
    assert alice.responses.retrieve(second.id).to_dict() == second.to_dict()


def test_max_output_tokens_makes_it_incomplete(alice):
    cut = alice.responses.create(
        input="Write a long poem about the sea.", model="default", max_output_tokens=2
    )
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2 and cut.output[0].status == "incomplete"
    events = stream_events(
        alice, input="Write a long poem about the sea.", model="default", max_output_tokens=2
    )
    assert check_stream(events).status == "incomplete"
    assert events[-1].type == "response.incomplete"


def test_get_delete_and_other_tenants(alice, bob, alice_http):
    made = alice.responses.create(
        input="Say hi.", metadata={"topic": "greeting"}, top_p=0.5, **GREEDY
    )
    assert made.metadata == {"topic": "greeting"} and made.top_p == 0.5
    assert alice.responses.retrieve(made.id).to_dict() == made.to_dict()
    # Another tenant: not found, whether it reads, deletes or continues it.
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as err:
        bob.responses.create(input="Hello?", previous_response_id=made.id, **GREEDY)
    assert err.value.body["param"] == "previous_response_id"
    assert alice.responses.retrieve(made.id).id == made.id  # bob's delete did nothing
    deleted = alice_http.delete(f"/v1/responses/{made.id}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": made.id, "object": "response.deleted", "deleted": True}
    gone = alice_http.get(f"/v1/responses/{made.id}")
    assert gone.status_code == 404
    assert gone.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve("resp_" + "0" * 32)
    assert alice_http.get("/v1/responses/" + "x" * 300).status_code == 404
    assert httpx.get(f"{alice_http.base_url}/v1/responses/{made.id}").status_code == 401


def test_stored_responses_are_not_sessions_in_the_admin_listing(alice, server):
    made = alice.responses.create(input="Say hi.", **GREEDY)
    listed = httpx.get(
        f"{server.url}/admin/sessions",
        params={"limit": 100},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert listed.status_code == 200
    rows = listed.json()["data"]
    assert all(r["tenant"] in ("alice", "bob") for r in rows)  # no response namespace
    assert made.id not in {r["id"] for r in rows}
    assert extra(made, "session_id") in {r["id"] for r in rows}


def test_fork_from_an_older_response(alice, alice_http):
    q1, q2, q3 = "Pick a fruit.", "Why that one?", "Pick another fruit."
    first = alice.responses.create(input=q1, instructions=INSTRUCTIONS, **GREEDY)
    second = alice.responses.create(
        input=q2, instructions=INSTRUCTIONS, previous_response_id=first.id, **GREEDY
    )
    # From `first` again: the chain's session has moved on to `second`, so a new one.
    fork = alice.responses.create(
        input=q3, instructions=INSTRUCTIONS, previous_response_id=first.id, **GREEDY
    )
    chain_session, fork_session = extra(first, "session_id"), extra(fork, "session_id")
    assert fork_session != chain_session
    # Its shared prefix still comes from the engine's device prefix cache (whole blocks).
    assert fork.usage.input_tokens_details.cached_tokens > 0
    messages = [*history((q1, first.output_text)), {"role": "user", "content": q3}]
    assert fork.output_text == chat_reply(alice, messages)
    held = alice_http.get(f"/v1/sessions/{fork_session}").json()["messages"]
    assert held == [*messages, {"role": "assistant", "content": fork.output_text}]
    # The chain itself is untouched: continuing `second` stays in its session, KV reused.
    third = alice.responses.create(
        input="Thanks.", instructions=INSTRUCTIONS, previous_response_id=second.id, **GREEDY
    )
    assert extra(third, "session_id") == chain_session
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens
    # Deleting a response in the middle does not break the responses after it.
    alice.responses.delete(second.id)
    fourth = alice.responses.create(
        input="Bye.", instructions=INSTRUCTIONS, previous_response_id=third.id, **GREEDY
    )
    assert extra(fourth, "session_id") == chain_session
    # New instructions are not carried over from the chain (OpenAI's rule): a fork too.
    other = alice.responses.create(
        input="Bye.", instructions="Be formal.", previous_response_id=third.id, **GREEDY
    )
    assert extra(other, "session_id") != chain_session


def test_concurrent_continuations_of_one_response_both_succeed(alice):
    first = alice.responses.create(input="Name a river.", instructions=INSTRUCTIONS, **GREEDY)
    kw = {"input": "Where is it?", "instructions": INSTRUCTIONS, **GREEDY}
    with ThreadPoolExecutor(2) as pool:
        replies = list(
            pool.map(
                lambda _: alice.responses.create(previous_response_id=first.id, **kw), range(2)
            )
        )
    # One runs in the chain's session; the other (busy, or moved on) forks: no 409.
    assert len({extra(r, "session_id") for r in replies}) == 2
    assert extra(first, "session_id") in {extra(r, "session_id") for r in replies}
    assert replies[0].output_text == replies[1].output_text


def test_store_false_keeps_nothing(alice, alice_http):
    def sessions() -> set[str]:
        page = alice_http.get("/v1/sessions", params={"limit": 100}).json()
        return {s["id"] for s in page["data"]}

    kept = alice.responses.create(input="Name a planet.", **GREEDY)
    before = sessions()
    loose = alice.responses.create(
        input="Another one?", previous_response_id=kept.id, store=False, **GREEDY
    )
    assert loose.status in ("completed", "incomplete") and loose.output_text
    assert extra(loose, "session_id") is None
    assert sessions() == before  # its own session went with the turn
    chain = alice_http.get(f"/v1/sessions/{extra(kept, 'session_id')}").json()
    assert chain["num_messages"] == 2  # the chain's session did not take the turn
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(loose.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.create(input="More.", previous_response_id=loose.id, **GREEDY)


def test_input_items_and_content_parts(alice):
    q1 = "What is two plus two?"
    items = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": q1}]},
    ]
    made = alice.responses.create(input=items, **GREEDY)
    assert made.output_text == chat_reply(alice, [*history(), {"role": "user", "content": q1}])
    # A client replaying the output items as input, the SDK's way of keeping state itself.
    replay = [*items, *[o.to_dict() for o in made.output], {"role": "user", "content": "Sure?"}]
    again = alice.responses.create(input=replay, **GREEDY)
    messages = [*history((q1, made.output_text)), {"role": "user", "content": "Sure?"}]
    assert again.output_text == chat_reply(alice, messages)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": 42}, "input"),
        ({}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        ({"input": [{"role": "user", "content": 7}]}, "input.0.content"),
        ({"input": ["hello"]}, "input.0"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "previous_response_id": 5}, "previous_response_id"),
        ({"input": "x", "store": "maybe"}, "store"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": "x", "stop": ["", "a"]}, "stop"),
        ({"input": "x" * 40_000}, "input"),
        ('{"input": [{"role": "user", "content": "\\ud800"}]}', "input.0.content"),  # raw JSON
        ({"input": "x", "instructions": "y" * 40_000}, "instructions"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(alice_http, body, param):
    if isinstance(body, str):  # JSON that Python's encoder would not write (a lone surrogate)
        reply = alice_http.post(
            "/v1/responses", content=body, headers={"Content-Type": "application/json"}
        )
    else:
        reply = alice_http.post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == "invalid_request_error"


def test_unknown_previous_response_is_a_404(alice):
    with pytest.raises(openai.NotFoundError) as err:
        alice.responses.create(input="Hi", previous_response_id="resp_nope", **GREEDY)
    assert err.value.body["param"] == "previous_response_id"
    assert "resp_nope" in err.value.body["message"]


def test_responses_survive_a_restart(default_model, tmp_path):
    with (
        local_server(tmp_path, default_model, settings(), **STORE) as srv,
        sdk(srv.url, ALICE) as c,
    ):
        first = c.responses.create(input="Name a big city.", instructions=INSTRUCTIONS, **GREEDY)
    with (
        local_server(tmp_path, default_model, settings(), **STORE) as srv,
        sdk(srv.url, ALICE) as c,
    ):
        assert c.responses.retrieve(first.id).to_dict() == first.to_dict()
        second = c.responses.create(
            input="Name another.",
            instructions=INSTRUCTIONS,
            previous_response_id=first.id,
            **GREEDY,
        )
        assert extra(second, "session_id") == extra(first, "session_id")
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


@pytest.fixture(scope="module")
def small_server(default_model, tmp_path_factory):
    """Keyless, with a 1 MiB records map and conversations of at most 4 messages."""
    data = tmp_path_factory.mktemp("api-responses-small")
    small = ServerSettings(max_messages=4)
    with local_server(data, default_model, small, records_map_bytes=1 << 20, **STORE) as srv:
        yield srv


def test_a_conversation_past_max_messages_is_a_400(small_server):
    with sdk(small_server.url, "unused") as c:
        first = c.responses.create(input="Hi.", **GREEDY)
        second = c.responses.create(input="Hi again.", previous_response_id=first.id, **GREEDY)
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(input="And again.", previous_response_id=second.id, **GREEDY)
    assert err.value.body["code"] == "conversation_too_long"
    assert "max_messages" in err.value.body["message"]


def test_a_response_whose_session_cannot_be_kept_is_refused(small_server):
    """A full records store: 507 (JSON) or an `error` event (stream), never a stored response."""
    with (
        sdk(small_server.url, "unused") as c,
        httpx.Client(base_url=small_server.url, timeout=120) as http,
    ):
        filler = []
        for body in ({"metadata": {"pad": "x" * 15_000}}, {}):  # big sessions, then bare ones
            for _ in range(400):
                made = http.post("/v1/sessions", json=body)
                if made.status_code == 507:
                    break
                filler.append(made.json()["id"])
            else:
                pytest.fail("the 1 MiB records map never filled")
        with pytest.raises(openai.APIStatusError) as err:
            c.responses.create(input="Hello?", **GREEDY)
        assert err.value.status_code == 507 and err.value.body["code"] == "store_full"
        events = stream_events(c, input="Hello again?", **GREEDY)
        types = [e.type for e in events]
        assert types[:4] == OPENING and types[-1] == "error"
        assert "response.completed" not in types and "response.incomplete" not in types
        assert events[-1].code == "store_full" and events[-1].message
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(events[0].response.id)
        for sid in filler:
            assert http.delete(f"/v1/sessions/{sid}").status_code == 200
        back = c.responses.create(input="Hello?", **GREEDY)
        assert c.responses.retrieve(back.id).output_text == back.output_text
