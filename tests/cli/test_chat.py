"""`chatstore chat` driven through a pseudo-terminal (pexpect), against a real server on a free
loopback port with the embedded default model (API keys on), and once with --local."""

from __future__ import annotations

import os
import re
import signal
import sys

import httpx
import pexpect
import pytest

from chatstore.api.common.settings import ServerSettings
from chatstore.server.launcher import ServerThread, local_server

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

KEY = "chat-test-key"
PROMPT = "you> "
STATS = re.compile(r"\[(\d+) tokens · TTFT \d+ ms.*cached (\d+)/(\d+).*\]\r\n")
SESSION = re.compile(r"new session (\S+)\r\n")


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("cli-chat")
    settings = ServerSettings(api_keys={KEY: "alice"}, purge_interval_s=0)
    with local_server(data, default_model, settings, kv_cache_bytes=32 << 20) as srv:
        yield srv


@pytest.fixture
def http(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        yield client


@pytest.fixture
def env(tmp_path):
    """The child's environment: history under tmp_path, no key from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATSTORE_API_KEY")}
    env["CHATSTORE_HISTORY"] = str(tmp_path / "history")
    return env


def spawn(
    args: list[str], env: dict[str, str], timeout: float = 60, **kwargs: object
) -> pexpect.spawn:
    argv = ["-m", "chatstore", "chat", "--max-tokens", "8", "--temperature", "0", *args]
    return pexpect.spawn(
        sys.executable,
        argv,
        env=env,
        encoding="utf-8",
        timeout=timeout,
        dimensions=(50, 200),
        **kwargs,
    )


def ignore_sigint() -> None:
    """How a shell starts a background job (and how some CI runners start everything)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def turn(child: pexpect.spawn, text: str) -> tuple[str, int, int]:
    """Send one message; the reply as printed, and the stats line's cached/prompt tokens."""
    child.expect_exact(PROMPT)
    child.sendline(text)
    child.expect_exact(text + "\r\n")  # the terminal's echo of the line
    child.expect(STATS)
    reply = child.before.strip()
    return reply, int(child.match.group(2)), int(child.match.group(3))


def command(child: pexpect.spawn, line: str) -> str:
    """Run a /command; what it printed up to the next prompt."""
    child.expect_exact(PROMPT)
    child.sendline(line)
    child.expect_exact(line + "\r\n")
    child.expect_exact(PROMPT)
    out = child.before
    child.sendline("")  # an empty line is ignored: puts the prompt back for the next expect
    return out


def stats_numbers(text: str) -> dict[str, int]:
    cached = re.search(r"cached tokens (\d+)/(\d+)", text)
    tiers = dict(re.findall(r"(device|dram|ssd|remote) (\d+)", text.split("by tier:")[1]))
    assert cached is not None, text
    return {"cached": int(cached.group(1)), **{k: int(v) for k, v in tiers.items()}}


def test_two_turns_stats_sessions_new(server, http, env, tmp_path):
    child = spawn(["--url", server.url, "--api-key", KEY, "--system", "Answer briefly."], env)
    child.expect(SESSION)
    sid = child.match.group(1)

    first, cached1, prompt1 = turn(child, "Name a planet.")
    second, cached2, _ = turn(child, "Name another one.")
    stored = http.get(f"/v1/sessions/{sid}").json()["messages"]
    replies = [m["content"] for m in stored if m["role"] == "assistant"]
    assert [first, second] == [r.replace("\n", "\r\n").strip() for r in replies]
    assert cached1 == 0 and cached2 >= prompt1  # the first turn's prompt is reused

    stats = command(child, "/stats")
    assert f"session {sid}" in stats and "turns 2" in stats
    numbers = stats_numbers(stats)
    assert numbers["cached"] == cached2 > 0
    assert set(numbers) == {"cached", "device", "dram", "ssd", "remote"}
    assert sum(numbers[t] for t in ("device", "dram", "ssd", "remote")) == cached2
    assert re.search(r"kv location (device|dram|ssd|remote)", stats), stats
    assert re.search(r"ttft \d+\.\d ms {2}tokens/s \d+\.\d", stats), stats

    listed = command(child, "/sessions")
    assert re.search(rf"\* {sid}  turns 2  tokens \d+", listed), listed

    child.expect_exact(PROMPT)
    child.sendline("/new")
    child.expect(SESSION)
    sid2 = child.match.group(1)
    assert sid2 != sid
    listed = command(child, "/sessions")
    assert re.search(rf"\* {sid2}  turns 0", listed) and f"  {sid}  turns 2" in listed

    switched = command(child, f"/switch {sid[:10]}")
    assert f"switched to {sid} (2 turns)" in switched
    child.expect_exact(PROMPT)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    history = tmp_path / "history"
    assert "Name a planet." in history.read_text() and history.stat().st_mode & 0o777 == 0o600
    ids = {s["id"] for s in http.get("/v1/sessions").json()["data"]}
    assert {sid, sid2} <= ids


def test_resume_and_ctrl_d(server, http, env):
    sid = http.post("/v1/sessions", json={}).json()["id"]
    child = spawn(["--url", server.url, "--api-key", KEY, "--session", sid], env)
    child.expect_exact(f"resumed session {sid} (0 turns)")
    turn(child, "Hello!")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert http.get(f"/v1/sessions/{sid}").json()["num_messages"] == 2


def test_ctrl_c_cancels_the_reply(server, http, env):
    # Started with SIGINT ignored, as from a background shell: Ctrl-C must still cancel.
    args = ["--url", server.url, "--api-key", KEY, "--max-tokens", "400"]
    child = spawn(args, env, preexec_fn=ignore_sigint)
    child.expect(SESSION)
    sid = child.match.group(1)
    child.expect_exact(PROMPT)
    child.sendline("Write a very long story about a dragon.")
    child.expect_exact("dragon.\r\n")
    child.expect(r"\w+ \w+")  # the reply has started streaming
    child.sendintr()
    child.expect_exact("[cancelled]")
    assert http.get(f"/v1/sessions/{sid}").json()["num_messages"] == 0  # nothing kept
    reply, _, _ = turn(child, "Hi.")  # the same socket carries the next turn
    assert reply
    child.expect_exact(PROMPT)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--api-key", "wrong"], "401: invalid API key (pass --api-key or set CHATSTORE_API_KEY)"),
        ([], "401: missing API key"),
        (["--api-key", KEY, "--session", "sess_unknown0"], "404: "),
    ],
)
def test_errors_are_clear(server, env, args, message):
    child = spawn(["--url", server.url, *args], env, timeout=30)
    out = child.read()
    child.close()
    assert child.exitstatus == 1
    assert f"chatstore chat: error: {message}" in out and "Traceback" not in out


def test_server_down(env):
    child = spawn(["--url", "http://127.0.0.1:9"], env, timeout=30)
    out = child.read()
    child.close()
    assert child.exitstatus == 1
    assert "cannot reach the server at http://127.0.0.1:9" in out and "Traceback" not in out


def test_server_restart_mid_chat(default_model, env, tmp_path):
    """The server goes away between turns: a clear error, the chat stays; once it is back on
    the same port the next line reconnects and the history's KV comes back from SSD."""
    first = local_server(tmp_path, default_model, ServerSettings(), kv_cache_bytes=16 << 20)
    first.start()
    child = spawn(["--url", first.url], env)
    turn(child, "Name a planet.")
    first.stop()
    child.expect_exact(PROMPT)
    child.sendline("Another?")
    child.expect_exact(f"error: cannot reach the server at {first.url}")
    rebuilt = local_server(tmp_path, default_model, ServerSettings(), kv_cache_bytes=16 << 20)
    with ServerThread(rebuilt.app, port=first.port):
        _, cached, _ = turn(child, "Another?")
        stats = command(child, "/stats")
        assert cached > 0 and stats_numbers(stats)["ssd"] == cached, stats
        child.expect_exact(PROMPT)
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_local(env, tmp_path):
    args = ["--local", "--data-dir", str(tmp_path / "data"), "--kv-cache-bytes", str(32 << 20)]
    child = spawn(args, env, timeout=180)
    child.expect(SESSION)
    reply, cached, prompt = turn(child, "Say hi.")
    assert reply.strip() and prompt > 0 and cached == 0
    stats = command(child, "/stats")
    assert "turns 1" in stats and stats_numbers(stats)["cached"] == 0
    # Local mode may read the admin session table: the turn's KV was saved to DRAM.
    assert re.search(r"kv location dram  kv bytes [\d.]+ (B|KiB|MiB|GiB) \(dram ", stats), stats
    child.expect_exact(PROMPT)
    child.sendline("/quit")
    child.expect(pexpect.EOF, timeout=60)
    child.close()
    assert child.exitstatus == 0
