"""`chatstore chat`: a line-based chat in the terminal over the sessions API.

Each line is one turn, streamed token by token over the session's WebSocket; lines starting
with '/' are commands (HELP below). History of typed lines is kept by readline in
$CHATSTORE_HISTORY (default ~/.chatstore_history). Ctrl-C during a reply cancels it on the
server; Ctrl-D or /quit leaves.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from chatstore.chat_client import (
    TIERS,
    ChatClient,
    ChatError,
    Delta,
    ReplyStats,
    SessionDetail,
    SessionSocket,
)

HISTORY_ENV = "CHATSTORE_HISTORY"
HISTORY_LINES = 1000
PROMPT = "you> "
HELP = """commands:
  /new [system prompt]   start a new session (with the given system prompt, or --system's)
  /sessions              your sessions: id, turns, tokens, where the KV is
  /switch <id>           continue another session (an id prefix shown by /sessions works)
  /stats                 this session: KV tier and bytes, turns; the last reply's TTFT,
                         tokens/s, cached tokens and which tier they came from
  /help                  this text
  /quit                  leave (Ctrl-D too); Ctrl-C stops a reply"""


def history_path() -> Path:
    return Path(os.environ.get(HISTORY_ENV) or Path.home() / ".chatstore_history")


def load_history() -> Callable[[], None]:
    """Read the saved lines into readline; the returned function writes them back."""
    try:
        import readline
    except ImportError:  # no readline on this platform: plain input(), no history
        return lambda: None
    path = history_path()
    readline.set_history_length(HISTORY_LINES)
    with contextlib.suppress(OSError):  # first run, or unreadable: start empty
        readline.read_history_file(path)

    def save() -> None:
        try:
            readline.write_history_file(path)
            path.chmod(0o600)  # what was typed may be private
        except OSError as exc:
            print(f"chatstore: could not save history to {path}: {exc}", file=sys.stderr)

    return save


def format_stats(stats: ReplyStats) -> str:
    """One line under a reply: tokens, TTFT, decode rate, cached tokens and their tiers."""
    parts = [f"{stats.completion_tokens} tokens"]
    if stats.ttft_ms is not None:
        parts.append(f"TTFT {stats.ttft_ms:.0f} ms")
    if stats.tokens_per_s is not None:
        parts.append(f"{stats.tokens_per_s:.1f} tok/s")
    parts.append(f"cached {stats.cached_tokens}/{stats.prompt_tokens}{tier_split(stats)}")
    return "[" + " · ".join(parts) + "]"


def tier_split(stats: ReplyStats) -> str:
    hit = [f"{tier} {stats.cached_by_tier[tier]}" for tier in TIERS if stats.cached_by_tier[tier]]
    return f" ({', '.join(hit)})" if hit else ""


def format_bytes(n: int) -> str:
    if n < 1 << 10:
        return f"{n} B"
    if n < 1 << 20:
        return f"{n / (1 << 10):.1f} KiB"
    if n < 1 << 30:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


class TerminalChat:
    def __init__(
        self,
        client: ChatClient,
        system: str | None = None,
        sampling: dict[str, object] | None = None,
        out: TextIO = sys.stdout,
    ) -> None:
        self.client = client
        self.system = system
        self.sampling = sampling or {}
        self.out = out
        self.socket: SessionSocket | None = None
        self.session_id: str | None = None
        self.last: ReplyStats | None = None

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def open(self, session_id: str | None) -> None:
        """Resume `session_id` (ChatError 404 if unknown) or start a new session."""
        if session_id is None:
            return self.new(None)
        detail = self.client.get_session(session_id)
        self.say(f"resumed session {session_id} ({detail.turns} turns)")
        self.attach(session_id, resumed=True)

    def attach(self, session_id: str, resumed: bool = False) -> None:
        socket = self.client.connect(session_id)
        self.detach()
        if session_id != self.session_id:
            self.last = None
        self.socket, self.session_id = socket, session_id
        if resumed:  # its KV may sit on SSD or in Redis: have the server bring it up now
            socket.typing()

    def detach(self) -> None:
        if self.socket is not None:
            self.socket.close()
            self.socket = None

    def run(self) -> int:
        """The read-eval loop; returns the exit code."""
        save_history = load_history()
        try:
            while True:
                try:
                    line = input(PROMPT).strip()
                except EOFError:
                    self.say()
                    return 0
                except KeyboardInterrupt:
                    self.say()
                    continue
                if line and not self.handle(line):
                    return 0
        finally:
            save_history()
            self.detach()

    def handle(self, line: str) -> bool:
        """One line; False when the user asked to leave. Errors are reported, not raised."""
        try:
            if line.startswith("/"):
                return self.command(line)
            self.turn(line)
        except ChatError as exc:
            self.say(f"error: {explain(exc, self.client.url)}")
        return True

    def command(self, line: str) -> bool:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return False
        actions: dict[str, Callable[[], None]] = {
            "/help": lambda: self.say(HELP),
            "/new": lambda: self.new(arg or None),
            "/sessions": self.sessions,
            "/switch": lambda: self.switch(arg),
            "/stats": self.stats,
        }
        action = actions.get(name)
        if action is None:
            self.say(f"unknown command {name}; /help lists them")
        else:
            action()
        return True

    def turn(self, text: str) -> None:
        if self.socket is None or not self.socket.is_open:
            # Lost while idle (server restarted, network): nothing was sent yet, so reconnect.
            assert self.session_id is not None
            self.attach(self.session_id)
        assert self.socket is not None
        events = self.socket.send(text, **self.sampling)
        try:
            for event in events:
                if isinstance(event, Delta):
                    self.out.write(event.text)
                    self.out.flush()
                else:
                    self.last = event.stats
                    self.say()
                    self.say(format_stats(event.stats))
        except KeyboardInterrupt:
            events.close()  # if it came between frames: the generator's exit cancels
            self.say("\n[cancelled]")
        except ChatError as exc:
            if exc.code is None and exc.status is None:  # the socket itself failed
                self.detach()
            self.say()
            raise

    def new(self, system: str | None) -> None:
        session_id = self.client.create_session(system or self.system).id
        self.attach(session_id)
        self.say(f"new session {session_id}")

    def sessions(self) -> None:
        rows = self.client.list_sessions()
        if not rows:
            self.say("no sessions")
        for s in rows:
            mark = "*" if s.id == self.session_id else " "
            kv = s.kv_location or "-"
            self.say(f"{mark} {s.id}  turns {s.turns}  tokens {s.num_tokens}  kv {kv}")

    def switch(self, prefix: str) -> None:
        if not prefix:
            self.say("usage: /switch <session id>")
            return
        matches = [s.id for s in self.client.list_sessions() if s.id.startswith(prefix)]
        if len(matches) > 1:
            self.say(f"{prefix!r} matches {len(matches)} sessions; give more of the id")
            return
        target = matches[0] if matches else prefix  # not listed (an older one): ask directly
        detail = self.client.get_session(target)
        self.attach(target, resumed=True)
        self.say(f"switched to {target} ({detail.turns} turns)")

    def kv_bytes_text(self, detail: SessionDetail) -> str:
        """From the session JSON if it says, else the admin table; '-' where neither does."""
        if detail.kv_bytes is not None:
            return format_bytes(detail.kv_bytes)
        footprint = self.client.kv_footprint(detail.summary.id)
        if footprint is None:
            return "-"
        split = ", ".join(f"{t} {format_bytes(n)}" for t, n in footprint.bytes_by_tier.items())
        return format_bytes(footprint.kv_bytes) + (f" ({split})" if split else "")

    def stats(self) -> None:
        assert self.session_id is not None
        detail = self.client.get_session(self.session_id)
        s = detail.summary
        kv_bytes = self.kv_bytes_text(detail)
        self.say(f"session {s.id}")
        self.say(f"  turns {detail.turns}  tokens {s.num_tokens}  messages {s.num_messages}")
        self.say(f"  kv location {s.kv_location or '-'}  kv bytes {kv_bytes}")
        if self.last is None:
            self.say("  last reply: none in this run yet")
            return
        last = self.last
        rate = "-" if last.tokens_per_s is None else f"{last.tokens_per_s:.1f}"
        ttft = "-" if last.ttft_ms is None else f"{last.ttft_ms:.1f} ms"
        self.say(f"  last reply: ttft {ttft}  tokens/s {rate}  tokens {last.completion_tokens}")
        split = "  ".join(f"{t} {last.cached_by_tier[t]}" for t in TIERS)
        self.say(f"  cached tokens {last.cached_tokens}/{last.prompt_tokens}  by tier: {split}")


def explain(exc: ChatError, url: str) -> str:
    """The error with what to do about it."""
    if exc.status is None and exc.code is None:
        return f"{exc} (is `chatstore serve` running there? or use `chatstore chat --local`)"
    if exc.status == 401:
        return f"{exc} (pass --api-key or set CHATSTORE_API_KEY)"
    if exc.status == 404:
        return f"{exc} (/sessions lists yours; without --session a new one is made)"
    return str(exc)


def run_chat(
    client: ChatClient,
    session_id: str | None,
    system: str | None,
    sampling: dict[str, object],
) -> int:
    """Open (or resume) a session and chat until the user leaves; the exit code."""
    # Ctrl-C must cancel a reply even when the shell started us with SIGINT ignored (a
    # background job, nohup, some CI runners): Python then installs no handler of its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    chat = TerminalChat(client, system, sampling)
    try:
        chat.open(session_id)
    except ChatError as exc:
        print(f"chatstore chat: error: {explain(exc, client.url)}", file=sys.stderr)
        return 1
    chat.say(f"chatting with {client.url}; /help for commands, Ctrl-D to leave")
    return chat.run()
