"""Served speed of an OpenAI-compatible server, for `bench/engine_speed.py --vllm`.

A server runs as its own process group (`chatstore serve`, or vLLM's CPU build through
`serve.sh` of the peer scripts) and is always stopped by that group, also on errors and Ctrl-C.
Every request is a streaming `/v1/chat/completions` at temperature 0 with EOS banned through
`logit_bias`; every prompt is sized with the model's own tokenizer and chat template, so both
servers get the same messages (checked against `usage.prompt_tokens`).

    prefill   TTFT of one fresh prompt (max_tokens 1, unique from its first block on, so no prefix
              hit): tok/s = usage.prompt_tokens / TTFT
    decode    N concurrent streams of `decode_tokens` each; aggregate tok/s =
              Σ over streams (completion_tokens - 1) / (last token of any stream - first token of
              the first stream): only tokens after each stream's own first one count. Median of
              the repeats, fewer for big batches: none past the one that reaches ~2K tokens
    history   a conversation of ~L tokens (max_tokens 1), a 0.5 s pause (the user reading), then
              the same messages plus a new ~100-token user message: TTFT of that second request,
              whose history the server already holds (vLLM: its prefix cache; chatstore: the
              session named by X-Session-ID on both requests)

TTFT is client-side: request sent -> first chunk carrying a token (or the finish), on loopback.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

Message = dict[str, str]
BAN_EOS = {"2": -100, "0": -100}  # <|im_end|> and <|endoftext|>: every stream runs to max_tokens
MODEL_NAME = "smollm2-135m-instruct"  # serve.sh's served name; chatstore accepts any
THINK_S = 0.5
DECODE_TIMED_TOKENS = 2048
TIMEOUT_S = 600
WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven"),
    *("wizards", "quietly", "judge", "boxing", "matches", "near", "old", "river", "banks"),
]

# -- server processes ---------------------------------------------------------------------------

_LIVE: set[ServerProcess] = set()


class ServerProcess:
    """One server in its own session (process group); a context manager that always stops it."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], port: int, ready_path: str,
        log_path: Path, start_timeout_s: float,
    ) -> None:  # fmt: skip
        self.name, self.argv, self.env = name, argv, env
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path, self.log_path, self.start_timeout_s = ready_path, log_path, start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        t0 = time.perf_counter()
        with self.log_path.open("wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        _LIVE.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        print(f"  {self.name} ready at {self.url} in {time.perf_counter() - t0:.0f} s", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        with httpx.Client(trust_env=False, timeout=2) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode} while starting; "
                        f"its log ({self.log_path}) ends:\n{self.log_tail()}"
                    )
                try:
                    if http.get(self.url + self.ready_path).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(
            f"{self.name} not ready after {self.start_timeout_s:.0f} s; its log ends:\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL to whatever is left after a grace period: vLLM's
        engine-core child can outlive the API process it was started by."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the leader's pid is the group's id
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)
        proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs; zombies waiting to be reaped do not count."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@atexit.register
def stop_all_servers() -> None:
    for server in list(_LIVE):
        server.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chatstore_server(data_dir: Path, log_dir: Path) -> ServerProcess:
    """`chatstore serve` with its defaults: only the port and a scratch data dir are set."""
    port = free_port()
    exe = Path(sys.executable).with_name("chatstore")
    argv = [str(exe)] if exe.is_file() else [sys.executable, "-m", "chatstore"]
    argv += ["serve", "--port", str(port), "--data-dir", str(data_dir)]
    # Local mode (no keys) whatever the caller's environment says: the bench sends none.
    env = {**os.environ, "CHATSTORE_API_KEYS": "", "CHATSTORE_ADMIN_KEY": ""}
    return ServerProcess("chatstore", argv, env, port, "/readyz", log_dir / "chatstore.log", 180)


def vllm_venv() -> Path:
    """Where serve.sh looks for vLLM's venv (its own defaults, same env knobs)."""
    home = Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "chatstore-peers"))
    return Path(os.environ.get("VENV", home / "vllm" / "venv"))


def ensure_vllm(scripts: Path) -> None:
    """The peer scripts exist and vLLM's venv is made (running setup.sh once if it is not)."""
    if not (scripts / "serve.sh").is_file() or not (scripts / "setup.sh").is_file():
        raise SystemExit(f"--vllm needs serve.sh and setup.sh in {scripts} (see --vllm-scripts)")
    if (vllm_venv() / "bin" / "python").is_file():
        return
    print(f"vLLM's venv {vllm_venv()} is missing: running setup.sh (a few minutes)", flush=True)
    rc = subprocess.run(["bash", str(scripts / "setup.sh")]).returncode
    if rc != 0 or not (vllm_venv() / "bin" / "python").is_file():
        raise SystemExit(f"vLLM setup failed (exit {rc}); run it by hand: bash {scripts}/setup.sh")


def vllm_server(scripts: Path, dtype: str, model_dir: Path, log_dir: Path) -> ServerProcess:
    port = free_port()
    env = {**os.environ, "PORT": str(port), "DTYPE": dtype, "MODEL": str(model_dir)}
    # Prompt-tokens details only add cached_tokens to usage: the check that the history hit.
    argv = ["bash", str(scripts / "serve.sh"), "--enable-prompt-tokens-details"]
    log_path = log_dir / f"vllm-{dtype}.log"
    return ServerProcess(f"vLLM-CPU {dtype}", argv, env, port, "/health", log_path, 420)


# -- prompts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HistoryCase:
    length: int  # the target size of the history, in prompt tokens
    history: list[Message]  # ends with a user message
    follow_up: list[Message]  # history + one new user message of ~new_tokens


@dataclass(frozen=True)
class Workload:
    warmup: list[Message]  # a mid-size prompt, so no first-use cost lands in a measurement
    warmup_history: HistoryCase  # the same for the session / prefix-cache path
    prefill: list[list[Message]]  # one fresh prompt per repeat
    decode_batches: tuple[int, ...]
    decode_tokens: int
    reps: int
    history: list[list[HistoryCase]]  # per repeat, by length


class PromptMaker:
    """Messages of an exact-ish token count under the model's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def count(self, messages: list[Message]) -> int:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def fill(self, head: list[Message], role: str, words: list[str], target: int) -> list[Message]:
        """`head` + one `role` message of the most of `words` keeping the prompt <= target."""
        lo, hi = 1, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count([*head, _msg(role, words[:mid])]) <= target:
                lo = mid
            else:
                hi = mid - 1
        return [*head, _msg(role, words[:lo])]

    def fresh_prompt(self, tag: str, tokens: int) -> list[Message]:
        rng = random.Random(tag)
        # The tag leads the system message, so no two prompts share a first KV block.
        head = [_msg("system", f"[{tag}] You are a helpful assistant.")]
        return self.fill(head, "user", _words(rng, tokens), tokens)

    def history_cases(self, tag: str, lengths: list[int], new_tokens: int) -> list[HistoryCase]:
        """One conversation grown through every length (shorter ones are its prefixes up to the
        last user message, so the unmeasured first sends share most of their prefill)."""
        rng, turn = random.Random(tag), 250
        head = [_msg("system", f"[{tag}] You are a helpful assistant.")]
        user_words = _words(rng, 4 * turn)
        cases = []
        for length in sorted(lengths):
            while True:
                pair = [_msg("user", user_words[:turn]), _msg("assistant", _words(rng, turn))]
                if self.count(head + pair) + 16 > length:
                    break
                head += pair
                user_words = _words(rng, 4 * turn)
            history = self.fill(head, "user", user_words, length)
            target = self.count(history) + new_tokens
            follow_up = self.fill(history, "user", _words(rng, 2 * new_tokens), target)
            cases.append(HistoryCase(length, history, follow_up))
        return cases


def _msg(role: str, words: list[str] | str) -> Message:
    return {"role": role, "content": words if isinstance(words, str) else " ".join(words)}


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def decode_prompts(batch: int, rep: int) -> list[list[Message]]:
    return [
        [_msg("user", f"({batch}.{rep}.{i}) Write a long story about a lighthouse keeper.")]
        for i in range(batch)
    ]


# -- the client ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    sent: float  # perf_counter when the request went out
    first: float  # the first chunk carrying a token (or the finish)
    last: float  # the last chunk carrying text
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None

    @property
    def ttft(self) -> float:
        return self.first - self.sent


def stream_chat(
    http: httpx.Client, url: str, messages: list[Message], max_tokens: int, session: str = ""
) -> Stream:
    body = {
        "model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "logit_bias": BAN_EOS,
    }  # fmt: skip
    headers = {"X-Session-ID": session} if session else {}
    deadline = time.monotonic() + 30
    while True:
        sent = time.perf_counter()
        with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            # 409: the session's previous turn is still closing on the server; the clock restarts.
            if r.status_code == 409 and time.monotonic() < deadline:
                r.read()
                time.sleep(0.02)
                continue
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
            return _read_stream(r, sent)


def _read_stream(r: httpx.Response, sent: float) -> Stream:
    first = last = None
    usage: dict[str, Any] | None = None
    for line in r.iter_lines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"stream error: {event['error']}")
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text or choice.get("finish_reason"):
                now = time.perf_counter()
                first = first or now
                last = now if text or last is None else last
    if first is None or last is None or usage is None:
        raise RuntimeError("stream ended without a token or without usage")
    details = usage.get("prompt_tokens_details") or {}
    return Stream(
        sent, first, last, usage["prompt_tokens"], usage["completion_tokens"],
        details.get("cached_tokens"),
    )  # fmt: skip


def concurrent_streams(url: str, prompts: list[list[Message]], max_tokens: int) -> list[Stream]:
    """All prompts at once, one thread each, released together."""
    barrier = threading.Barrier(len(prompts))
    limits = httpx.Limits(max_connections=len(prompts) + 2)
    with httpx.Client(trust_env=False, timeout=TIMEOUT_S, limits=limits) as http:

        def one(messages: list[Message]) -> Stream:
            barrier.wait(timeout=60)
            return stream_chat(http, url, messages, max_tokens)

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))


def decode_rate(streams: list[Stream]) -> float:
    tokens = sum(s.completion_tokens - 1 for s in streams)
    return tokens / (max(s.last for s in streams) - min(s.first for s in streams))


# -- one server's measurements ------------------------------------------------------------------


@dataclass
class ServedSpeed:
    prefill_tok_s: float = 0.0
    prefill_tokens: int = 0
    decode_tok_s: dict[int, float] = field(default_factory=dict)
    history_ttft_s: dict[int, float] = field(default_factory=dict)
    history_tokens: dict[int, int] = field(default_factory=dict)  # the second request's prompt
    history_cached: dict[int, int | None] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def measure(url: str, work: Workload, sessions: bool, say: Callable[[str], None]) -> ServedSpeed:
    """Warm-up, then prefill, decode at each batch size and history prefill; medians."""
    out = ServedSpeed()
    with httpx.Client(trust_env=False, timeout=TIMEOUT_S) as http:
        stream_chat(http, url, work.warmup, 8)
        _history_pair(http, url, work.warmup_history, "bench-warm-up" if sessions else "")
        concurrent_streams(url, decode_prompts(4, -1), 16)
        prefill = [stream_chat(http, url, m, 1) for m in work.prefill]
        out.prefill_tokens = prefill[0].prompt_tokens
        out.prefill_tok_s = statistics.median(s.prompt_tokens / s.ttft for s in prefill)
        cached = max(s.cached_tokens or 0 for s in prefill)
        if cached:
            out.warnings.append(f"fresh prefill prompts hit {cached} cached tokens")
        say(f"prefill {out.prefill_tokens} tokens: {out.prefill_tok_s:.1f} tok/s")
        for batch in work.decode_batches:
            out.decode_tok_s[batch] = _decode(url, work, batch, out.warnings)
            say(f"decode b={batch}: {out.decode_tok_s[batch]:.1f} tok/s")
        _history(http, url, work, sessions, out)
    for length, ttft in out.history_ttft_s.items():
        got, hit = out.history_tokens[length], out.history_cached[length]
        say(f"history {length} + new: TTFT {ttft * 1000:.1f} ms ({got} tokens, {hit} cached)")
    return out


def _decode(url: str, work: Workload, batch: int, warnings: list[str]) -> float:
    # A big batch times thousands of tokens in one go; repeating it would only cost minutes.
    reps = max(1, min(work.reps, DECODE_TIMED_TOKENS // (batch * work.decode_tokens)))
    rates = []
    for rep in range(reps):
        streams = concurrent_streams(url, decode_prompts(batch, rep), work.decode_tokens)
        short = [s.completion_tokens for s in streams if s.completion_tokens != work.decode_tokens]
        if short:
            warnings.append(f"decode b={batch}: streams ended at {short} tokens")
        rates.append(decode_rate(streams))
    return statistics.median(rates)


def _history(
    http: httpx.Client, url: str, work: Workload, sessions: bool, out: ServedSpeed
) -> None:
    ttfts: dict[int, list[float]] = {}
    for rep, cases in enumerate(work.history):
        for case in cases:
            sid = f"bench-{rep}-{case.length}" if sessions else ""
            second = _history_pair(http, url, case, sid)
            ttfts.setdefault(case.length, []).append(second.ttft)
            out.history_tokens[case.length] = second.prompt_tokens
            out.history_cached[case.length] = second.cached_tokens
            if second.cached_tokens == 0:
                out.warnings.append(f"history {case.length}: the second request hit no cache")
    out.history_ttft_s = {n: statistics.median(t) for n, t in ttfts.items()}


def _history_pair(http: httpx.Client, url: str, case: HistoryCase, session: str) -> Stream:
    stream_chat(http, url, case.history, 1, session)
    time.sleep(THINK_S)
    return stream_chat(http, url, case.follow_up, 1, session)
