"""The browser pages in a real browser (Debian's chromium driven by Playwright) against real
servers on the default model: the chat at `/` (open ready to type, sessions titled by their first
message, replies streamed over the WebSocket, cached tokens, the page's own overhead) and the
cache dashboard at `/admin/ui`, in local mode and with API keys.

Screenshots go to the test's tmp dir, and also to $CHATSTORE_SCREENSHOTS_DIR when it is set
(`CHATSTORE_SCREENSHOTS_DIR=docs/img` makes the images in README.md and docs/).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright

from chatstore.api.common.settings import ServerSettings
from chatstore.server.launcher import local_server

CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

ALICE, BOB, ADMIN = "key-alice", "key-bob", "key-admin"
SMALL = {"kv_cache_bytes": 32 << 20, "dram_bytes": 64 << 20}
TIER_KEYS = (
    "used_bytes",
    "capacity_bytes",
    "sessions",
    "hits",
    "misses",
    "bytes_up",
    "bytes_down",
    "evictions",
    "prefetches",
)
WAIT_MS = 60_000
# Chromium logs every non-2xx fetch; a 401/403 is how the pages learn to ask for a key.
ASKED_FOR_KEY = re.compile(r"Failed to load resource: .* status of 40[13] ")


@pytest.fixture(scope="module")
def local(default_model, tmp_path_factory):
    with local_server(tmp_path_factory.mktemp("pages-local"), default_model, **SMALL) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed(default_model, tmp_path_factory):
    settings = ServerSettings(api_keys={ALICE: "alice", BOB: "bob"}, admin_key=ADMIN)
    with local_server(
        tmp_path_factory.mktemp("pages-keyed"), default_model, settings, **SMALL
    ) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip("needs Debian's chromium (make installs it)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def open_page(browser):
    """A page in a fresh context (own storage); fails the test on any script or CSP error."""
    contexts, errors = [], []

    def make(url: str):
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.goto(url)
        return page

    yield make
    for context in contexts:
        context.close()
    assert not [e for e in errors if not ASKED_FOR_KEY.match(e)], errors


def screenshot(page, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    target = os.environ.get("CHATSTORE_SCREENSHOTS_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / name)


def new_chat(page, system_prompt: str) -> set[str]:
    """Open a new chat with a system prompt (behind "New chat"); the sessions listed before it.
    Its session is created by the first message: `started_session` finds it."""
    page.click("#new-chat")
    page.click("#draft-options summary")
    page.fill("#system-prompt", system_prompt)
    return set(listed(page))


def started_session(page, before: set[str]) -> str:
    """The session the new chat's first message created: listed, and the socket connected."""
    page.wait_for_function(
        "n => document.querySelectorAll('#sessions li').length > n", arg=len(before)
    )
    page.wait_for_function(
        "() => document.querySelector('#status').textContent.endsWith(': connected')"
    )
    (new,) = set(listed(page)) - before
    return new


def title_of(page, session_id: str) -> str:
    return page.locator(f"#sessions li[data-id='{session_id}'] .open").text_content()


def watch_last_reply(page) -> None:
    """Record the text length of the newest assistant message at every DOM change."""
    page.evaluate(
        """() => {
          window.replyLengths = [];
          const box = document.querySelector('#messages');
          new MutationObserver(() => {
            const texts = box.querySelectorAll('.msg.assistant .text');
            if (texts.length) window.replyLengths.push(texts[texts.length - 1].textContent.length);
          }).observe(box, {childList: true, subtree: true, characterData: true});
        }"""
    )


def send(page, text: str, max_tokens: int = 12) -> dict:
    """Type (sending typing hints) and send one message; the page's record of the reply."""
    done = page.evaluate("() => window.chatstoreTimings.length")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    watch_last_reply(page)
    page.locator("#input").press_sequentially(text, delay=5)
    page.press("#input", "Enter")
    page.wait_for_function(f"() => window.chatstoreTimings.length > {done}", timeout=WAIT_MS)
    timing = page.evaluate("() => window.chatstoreTimings[window.chatstoreTimings.length - 1]")
    lengths = [n for n in page.evaluate("() => window.replyLengths") if n > 0]
    final = page.locator(".msg.assistant .text").last.text_content()
    assert timing["deltas"] > 1 and len(set(lengths)) > 1, (timing, lengths)
    assert lengths == sorted(lengths) and lengths[-1] == len(final) > 0
    return timing


def listed(page) -> list[str]:
    return page.locator("#sessions li").evaluate_all("els => els.map(e => e.dataset.id)")


def test_chat_streams_replies_with_cached_history(local, open_page, tmp_path):
    page = open_page(local.url + "/")
    page.wait_for_selector("#no-sessions:not([hidden])")
    assert not page.locator("#key-dialog").evaluate("d => d.open")  # local mode: no key asked
    before = new_chat(page, "You answer in one short sentence.")
    first = send(page, "Name a planet.")
    sid = started_session(page, before)
    second = send(page, "Name another one.")
    third = send(page, "And a moon?")
    assert first["session_id"] == second["session_id"] == sid
    for later in (second, third):
        assert later["cached_tokens"] > 0 and later["prompt_tokens"] > first["prompt_tokens"]
    stats = page.locator(".msg.assistant .stats").all_text_contents()
    assert len(stats) == 3 and "TTFT" in stats[1] and "tok/s" in stats[1]
    cached = page.locator(".stat-cached").evaluate_all("els => els.map(e => +e.dataset.value)")
    assert cached[1:] == [second["cached_tokens"], third["cached_tokens"]]
    assert page.evaluate("() => window.chatstoreTypingHints") >= 1
    overheads = [round(t["overhead_ms"], 2) for t in (first, second, third)]
    every = [d for t in (first, second, third) for d in t["delta_overheads_ms"]]
    render = [
        round(t["first_token_shown_ms"] - t["first_token_received_ms"], 2)
        for t in (first, second, third)
    ]
    p50 = statistics.median(overheads)
    print(
        f"\npage overhead, server first token -> on screen: p50 {p50:.2f} ms (goal <= 30), "
        f"per reply {overheads}, of which message event -> in the DOM {render}; "
        f"every delta: p50 {statistics.median(every):.2f} ms, max {max(every):.2f} ms "
        f"over {len(every)}"
    )
    # Same host, same clock. Liveness only: every reply reaches the screen within a second of
    # the server sending it. The goal (p50 <= 30 ms) is measured, not asserted: quiet, this is
    # ~1 ms; a loaded 2-core runner (the engine decoding on both cores while the browser waits
    # for one) has shown 30-40 ms.
    assert all(o > -5 for o in every) and max(overheads) < 1000, overheads
    # The record the page shows on reload is the server's.
    record = httpx.get(f"{local.url}/v1/sessions/{sid}", timeout=30).json()
    assert len(record["messages"]) == 7  # system + 3 × (user, assistant)
    screenshot(page, tmp_path, "chat.png")
    page.reload()
    page.click(f"#sessions li[data-id='{sid}'] .open")
    page.wait_for_function("() => document.querySelectorAll('#messages .msg').length === 7")
    delete = page.locator(f"#sessions li[data-id='{sid}'] .delete")
    delete.click()
    delete.click()  # the second click confirms
    page.wait_for_function(f"() => !document.querySelector(\"#sessions li[data-id='{sid}']\")")
    assert httpx.get(f"{local.url}/v1/sessions/{sid}", timeout=30).status_code == 404


def test_chat_opens_ready_and_titles_sessions_by_first_message(local, open_page):
    # A session started elsewhere (the API, the terminal client): its title comes from its
    # messages, which the page reads once; a long first message is cut with an ellipsis.
    long_first = "Please tell me, in a single short sentence, which planet is the largest one?"
    http = httpx.Client(base_url=local.url, timeout=60)
    elsewhere = http.post("/v1/sessions", json={"system_prompt": "Be brief."}).json()["id"]
    turn = {"content": long_first, "max_tokens": 2, "temperature": 0}
    assert http.post(f"/v1/sessions/{elsewhere}/messages", json=turn).status_code == 200
    http.close()
    page = open_page(local.url + "/")
    # Ready at once: the message box has the focus, the system prompt is folded away.
    page.wait_for_function("() => document.activeElement === document.querySelector('#input')")
    assert page.locator("#system-prompt").is_hidden()
    page.wait_for_selector(f"#sessions li[data-id='{elsewhere}']")
    before = set(listed(page))
    assert title_of(page, elsewhere) == long_first[:47] + "…"
    page.keyboard.type("Name a colour.")  # into whatever has the focus: the message box
    page.keyboard.press("Enter")
    page.wait_for_function("() => window.chatstoreTimings.length === 1", timeout=WAIT_MS)
    assert page.locator(".msg.assistant .text").last.text_content().strip()
    sid = started_session(page, before)
    assert page.evaluate("() => window.chatstoreTimings[0].session_id") == sid
    assert title_of(page, sid) == "Name a colour."
    assert page.locator(f"#sessions li[data-id='{sid}']").get_attribute("class") == "active"
    # "New chat" opens an empty one, ready to type into; the first stays listed by its title.
    page.click("#new-chat")
    assert page.locator("#messages .msg").count() == 0
    assert page.evaluate("() => document.activeElement.id") == "input"
    page.reload()
    page.wait_for_selector(f"#sessions li[data-id='{sid}']")
    assert title_of(page, sid) == "Name a colour."


def dashboard_tiers(page) -> dict[str, dict[str, int]]:
    cells = page.locator("dd[data-tier]").evaluate_all(
        "els => els.map(e => [e.dataset.tier, e.dataset.key, e.dataset.raw])"
    )
    tiers: dict[str, dict[str, int]] = {}
    for tier, key, raw in cells:
        tiers.setdefault(tier, {})[key] = int(raw)
    return tiers


def served_tiers(cache: dict) -> dict[str, dict[str, int]]:
    return {t["name"]: {k: t[k] for k in TIER_KEYS} for t in cache["tiers"]}


def refresh_dashboard(page) -> None:
    done = page.evaluate("() => window.chatstoreDashboard.refreshes")
    page.click("#refresh")
    page.wait_for_function(f"() => window.chatstoreDashboard.refreshes > {done}")


def test_dashboard_shows_what_admin_cache_says(local, open_page, tmp_path):
    http = httpx.Client(base_url=local.url, timeout=60)
    sid = http.post("/v1/sessions", json={"system_prompt": "Be brief."}).json()["id"]
    for content in ("Hello!", "Say it again."):
        turn = {"content": content, "max_tokens": 8, "temperature": 0}
        assert http.post(f"/v1/sessions/{sid}/messages", json=turn).status_code == 200
    page = open_page(local.url + "/admin/ui")
    page.wait_for_function("() => window.chatstoreDashboard.refreshes > 0")
    page.click("#pause")
    # Compare only while the store is still: the same answer before and after the page's poll.
    for _ in range(10):
        before = served_tiers(http.get("/admin/cache").json())
        refresh_dashboard(page)
        shown = dashboard_tiers(page)
        after = http.get("/admin/cache").json()
        if served_tiers(after) == before:
            break
        time.sleep(0.5)
    assert before and shown == before == served_tiers(after)
    engine = {
        key: page.locator(f"dd[data-engine][data-key='{key}']").get_attribute("data-raw")
        for key in ("num_blocks", "block_size", "waiting", "running")
    }
    assert engine == {k: str(after["engine"][k]) for k in engine}
    cells = page.locator(f"#sessions tr[data-session='{sid}'] td").evaluate_all(
        "tds => Object.fromEntries(tds.map(td => [td.dataset.col, td.dataset.raw]))"
    )
    listing = http.get("/admin/sessions", params={"limit": 100}).json()["data"]
    (info,) = [s for s in listing if s["id"] == sid]
    for col in ("num_messages", "num_tokens", "kv_location"):
        assert cells[col] == str(info[col] or ""), col
    kv_table = after.get("sessions") or {}  # the per-session KV table, where the server has one
    for kv in (r for r in kv_table.get("data", []) if r["id"] == sid):
        assert cells["kv_bytes"] == str(kv["kv_bytes"]) and cells["priority"] == str(kv["priority"])
    # The plots' series: sampled by the server, with the turns' TTFTs in them.
    history = http.get("/admin/history").json()["data"]
    assert history and any(s["ttft_p50_ms"] for s in history), history
    assert {t["name"] for t in history[-1]["tiers"]} == set(before)
    assert page.locator("canvas").count() == 3
    screenshot(page, tmp_path, "dashboard.png")
    http.close()


def test_with_keys_each_tenant_sees_only_its_own(keyed, open_page):
    alice = open_page(keyed.url + "/")
    alice.wait_for_selector("#key-dialog[open]")
    alice.fill("#key-dialog input[name=key]", ALICE)
    alice.click("#key-dialog button[type=submit]")
    alice.wait_for_selector("#no-sessions:not([hidden])")
    before = new_chat(alice, "Be brief.")
    reply = send(alice, "Hi!", max_tokens=6)  # over the WebSocket, key in ?api_key=
    sid = started_session(alice, before)
    assert reply["session_id"] == sid
    # Stop: the turn is cancelled in the engine, the page is ready for the next message.
    alice.fill("#max-tokens", "400")  # the pool holds ~700 tokens: no preemption
    alice.fill("#input", "Count to a thousand.")
    alice.press("#input", "Enter")
    alice.wait_for_function(
        """() => {
          const text = document.querySelector('.msg.assistant.streaming .text');
          return text && text.textContent.length > 0;
        }"""
    )
    alice.click("#stop")
    alice.wait_for_selector(".msg.assistant .problem:text-is('stopped')")
    assert alice.locator("#send").is_enabled() and alice.locator("#stop").is_hidden()
    bob_own = httpx.post(
        keyed.url + "/v1/sessions", json={}, headers={"Authorization": f"Bearer {BOB}"}
    ).json()["id"]
    bob = open_page(keyed.url + "/")
    bob.wait_for_selector("#key-dialog[open]")
    bob.fill("#key-dialog input[name=key]", BOB)
    bob.click("#key-dialog button[type=submit]")
    bob.wait_for_selector(f"#sessions li[data-id='{bob_own}']")
    assert listed(bob) == [bob_own] and sid in listed(alice)
    # The dashboard wants the admin key: a tenant's is refused (403) and asked for again.
    admin = open_page(keyed.url + "/admin/ui")
    admin.wait_for_selector("#key-dialog[open]")
    admin.fill("#key-dialog input[name=key]", ALICE)
    admin.click("#key-dialog button[type=submit]")
    admin.wait_for_function(
        "() => document.querySelector('#key-dialog .reason').textContent.includes('admin key')"
    )
    admin.wait_for_selector("#key-dialog[open]")
    admin.fill("#key-dialog input[name=key]", ADMIN)
    admin.click("#key-dialog button[type=submit]")
    admin.wait_for_function("() => window.chatstoreDashboard.refreshes > 0")
    tenants = admin.locator("#sessions tr").evaluate_all("rs => rs.map(r => r.dataset.tenant)")
    assert sorted(tenants) == ["alice", "bob"]
    # The plots' data is the admin's too.
    history = keyed.url + "/admin/history"
    assert httpx.get(history, headers={"Authorization": f"Bearer {ALICE}"}).status_code == 403
    assert httpx.get(history, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert httpx.get(history).status_code == 401


def test_pages_are_served_under_a_strict_policy(local):
    for path in ("/", "/admin/ui", "/static/chat.js", "/static/style.css"):
        response = httpx.get(local.url + path, timeout=30)
        assert response.status_code == 200, path
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert response.headers["x-content-type-options"] == "nosniff"
    js = httpx.get(local.url + "/static/chat.js", timeout=30)
    assert js.headers["content-type"].startswith("text/javascript")
    again = httpx.get(local.url + "/static/chat.js", headers={"If-None-Match": js.headers["etag"]})
    assert again.status_code == 304
    for bad in ("/static/nope.js", "/static/..%2Fpages.py", "/static/pages.py"):
        assert httpx.get(local.url + bad, timeout=30).status_code == 404, bad
