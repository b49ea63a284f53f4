"""Agents: N concurrent tool loops against chatstore (store on), chatstore with the store off,
and (with --vllm) vLLM-CPU, the workload a session KV store exists for (issue 36 item 6).

Each agent has a ~3K-token system prompt of its own (its instructions, the tools' definitions, a
reference document) and the tools themselves (`tools`, `tool_choice: required`: on the embedded
SmolLM2 chatstore's generic form, its answer constrained by xgrammar to a call. vLLM gets the
same work: SmolLM2's template drops `tools`, so the client renders that generic form itself and
sends its answer schema as a strict `response_format` (bench/generic_tools.py: the same prompt
tokens, the same grammar, compact JSON on both); it loads the model directory with a
config.json, --vllm-model). A step is
one streamed /v1/chat/completions: the model's call, at once the tool's result (200-2,000
tokens, seeded) appended, the next step, no think time; the official OpenAI loop (the whole
history resent, `X-Session-ID` naming the agent's session on chatstore). An agent whose next
step would not fit the model's context (8,192 tokens) starts its next task: a new conversation
under the same system prompt (`conversation_resets` counts them).

Measured per server, one at a time on loopback, each stopped before the next starts:
  later-step TTFT     steps >= 10 (1 with --quick): request sent -> the first chunk carrying a
                      token (logprobs are asked for: a call's text is held until it is whole, its
                      tokens' logprobs are not), mean and p90
  later-step latency  request sent -> the step's last token, mean and p90: when the agent can act
                      (its call is whole). With no think time the loop is closed: N agents =
                      steps/s x (TTFT + decode span), so at saturation a server that stalls its
                      decodes behind long prefill steps shows a shorter TTFT at the same or a
                      longer latency; the latency is the like-for-like measure of throughput
  later-step end      request sent -> the response's end (the stream closed), mean and p90:
                      when a client that reads the whole response sends its next step; the gap
                      after the last token is the server's work on the turn before its last
                      frame (chatstore: the turn's KV chain recorded with its messages)
  output tok/s        completion tokens of every step / the agents' wall time
  prefix reuse share  later steps' prompt tokens served from the store (usage cached_tokens;
                      store off: from the engine's device prefix cache alone); its ceiling is
                      1 - the new tool result's share of the prompt
  history reuse share of what the server had seen of the conversation (the step before's prompt
                      and completion, less its last token), the share reused: 1.0 when each step
                      continues the one before token for token
and on chatstore (store on):
  json_valid_rate           constrained outputs that parse and validate against their schema:
                            every step's call (its arguments against its tool's parameters; a
                            step that returned no call counts as one invalid output; store on and
                            off alike), and 8 replies (2 with --quick) to a bounded json_schema
  tool_parse_ok             steps whose reply came back as valid tool_calls (the generic format)
  constrained_decode_ratio  decode tok/s of 8 concurrent streams (64 tokens) constrained by a
                            json_schema over the same prompts free (EOS banned in both, and the
                            schema's minItems keeps the grammar from ending, so both streams run
                            their 64 tokens; the median of three rounds, alternating)
Ratios (ours / theirs, mean later-step TTFT; below 1 when we are faster; null when that side did
not run): agent_ttft_ratio_vs_store_off, both chatstore servers with the small device pool
(--device-kv-tokens); agent_ttft_ratio_vs_vllm like for like in memory, vLLM's KV space
(--vllm-kv-gib, its serve.sh default 2 GiB) against a third chatstore server whose device pool
is as big ("chatstore_same_kv"); agent_ttft_ratio_vs_vllm_small_pool, chatstore's small pool
against that vLLM (what runs before 2026-11-28 reported as the ratio to vLLM);
agent_step_latency_ratio_vs_store_off / _vs_vllm, the same pairs by mean later-step latency;
agent_step_end_ratio_vs_vllm, by the mean later-step end.

    python bench/agentic.py [--agents 8] [--steps 30] [--quick] [--vllm] [--no-store-off]
                            [--device-kv-tokens 12288] [--vllm-kv-gib 2]

A human table, then the last line one JSON object. Do not trust a run on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.generic_tools import answer_calls, generic_request
from bench.machine import cpu_isa, cpu_model
from bench.peer_servers import (
    BAN_EOS,
    MODEL_NAME,
    WORDS,
    chatstore_server,
    ensure_vllm,
    vllm_server,
    vllm_venv,
)
from chatstore.config import resolve_dtype
from chatstore.model.spec import ModelSpec

PEER_SCRIPTS = Path(__file__).resolve().parents[2] / "shared" / "peers" / "vllm"
TIMEOUT_S = 600
CONTEXT = 8192  # SmolLM2's window; the server truncates past it, vLLM refuses
TOOLS = [
    {"name": "search_docs", "description": "Search the knowledge base.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 48}},
                    "required": ["query"], "additionalProperties": False}},
    {"name": "read_file", "description": "Read a file of the project.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 48}},
                    "required": ["path"], "additionalProperties": False}},
    {"name": "run_query", "description": "Run a read-only SQL query.",
     "parameters": {"type": "object", "properties": {"sql": {"type": "string", "maxLength": 64}},
                    "required": ["sql"], "additionalProperties": False}},
    {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                    "required": ["city"], "additionalProperties": False}},
]  # fmt: skip
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
NOTES = {  # minItems: the grammar cannot end (forcing EOS) before the decode_tokens are out
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
    "required": ["notes"],
    "additionalProperties": False,
}
SHORT = {  # a reply that must end well inside max_tokens: its validity is counted
    "type": "object",
    "properties": {
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 3}
    },
    "required": ["notes"],
    "additionalProperties": False,
}


# -- the workload ---------------------------------------------------------------------------------


class Sizer:
    """Seeded text of about n tokens of the model's tokenizer."""

    def __init__(self, tokenizer: object) -> None:
        sample = " ".join(random.Random(0).choices(WORDS, k=2000))
        self.per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / 2000  # type: ignore[attr-defined]

    def text(self, rng: random.Random, tokens: int) -> str:
        return " ".join(rng.choices(WORDS, k=max(1, round(tokens / self.per_word))))


@dataclass(frozen=True)
class Plan:
    agents: int
    steps: int
    system_tokens: int
    result_min: int
    result_max: int
    max_tokens: int
    later_step: int
    decode_batch: int
    decode_tokens: int
    seed: int
    reps: int = 3  # rounds of the decode ratio (free, constrained): their medians


def system_prompt(sizer: Sizer, plan: Plan, agent: int) -> str:
    rng = random.Random(plan.seed * 1000 + agent)
    head = (
        f"You are agent {agent}, an engineering assistant. Work step by step and call one "
        "tool at a time. Tools:\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\nReference:\n"
    )
    return head + sizer.text(rng, max(50, plan.system_tokens - 300))


def tool_result(sizer: Sizer, plan: Plan, agent: int, step: int) -> tuple[str, int]:
    rng = random.Random(f"{plan.seed}-{agent}-{step}")
    tokens = rng.randint(plan.result_min, plan.result_max)
    return sizer.text(rng, tokens), tokens


# -- one streamed step --------------------------------------------------------------------------


@dataclass
class Step:
    agent: int
    step: int
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    calls: list[dict[str, object]]
    valid_calls: int
    text: str
    first: float
    last: float
    finish: str | None = None
    task: int = 0  # the agent's conversation (a new one after a reset)
    end: float = 0.0  # request sent -> the response's end (the stream closed)


def stream_step(http: httpx.Client, url: str, body: dict, headers: dict) -> Step:
    sent = time.perf_counter()
    first = last = None
    usage: dict = {}
    calls: dict[int, dict] = {}
    text, finish = "", None
    with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                logprobs = (choice.get("logprobs") or {}).get("content")
                if logprobs or delta.get("content") or delta.get("tool_calls"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                text += delta.get("content") or ""
                for d in delta.get("tool_calls") or []:
                    acc = calls.setdefault(d["index"], {"id": "", "name": "", "arguments": ""})
                    acc["id"] = d.get("id") or acc["id"]
                    fn = d.get("function") or {}
                    acc["name"] += fn.get("name") or ""
                    acc["arguments"] += fn.get("arguments") or ""
    if first is None or not usage:
        raise RuntimeError(f"{url}: a stream without a token or without usage")
    found = [calls[i] for i in sorted(calls)]
    valid = sum(valid_json(c["arguments"], SCHEMAS.get(c["name"])) for c in found)
    details = usage.get("prompt_tokens_details") or {}
    return Step(
        -1, -1, first - sent, usage["prompt_tokens"], details.get("cached_tokens") or 0,
        usage["completion_tokens"], found, valid, text, first, last or first, finish,
        end=time.perf_counter() - sent,
    )  # fmt: skip


def valid_json(text: str, schema: dict | None) -> bool:
    """`text` parses and validates against `schema` (the subset these schemas use)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return schema is not None and _valid(value, schema)


def _valid(value: object, schema: dict) -> bool:
    kind = schema.get("type")
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "array":
        if not isinstance(value, list) or len(value) > schema.get("maxItems", len(value)):
            return False
        return all(_valid(v, schema.get("items", {})) for v in value)
    if kind == "object":
        props = schema.get("properties", {})
        if not isinstance(value, dict) or not set(schema.get("required", ())) <= set(value):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(_valid(v, props[k]) for k, v in value.items() if k in props)
    return True


# -- the agents ---------------------------------------------------------------------------------


@dataclass
class AgentRun:
    steps: list[Step] = field(default_factory=list)
    resets: int = 0
    wall_s: float = 0.0


def run_agents(
    url: str, plan: Plan, sizer: Sizer, name: str, sessions: bool, client_tools: bool = False
) -> AgentRun:
    """`client_tools`: the generic tool form rendered and constrained by the client
    (bench/generic_tools.py), for a peer whose model's template knows no tools."""
    barrier = threading.Barrier(plan.agents)
    limits = httpx.Limits(max_connections=plan.agents + 2)
    tools = [{"type": "function", "function": t} for t in TOOLS]
    out = AgentRun()

    def agent(i: int) -> list[Step]:
        system = {"role": "system", "content": system_prompt(sizer, plan, i)}
        task, size = 0, 0
        messages = [system, {"role": "user", "content": f"Task {task}: audit module {i}."}]
        done: list[Step] = []
        barrier.wait(timeout=120)
        for s in range(plan.steps):
            result, result_tokens = tool_result(sizer, plan, i, s)
            if size and size + result_tokens + 2 * plan.max_tokens + 64 > CONTEXT:
                task += 1
                out.resets += 1
                messages = [system, {"role": "user", "content": f"Task {task}: audit {i}."}]
            body = {
                "model": MODEL_NAME, "messages": messages, "tools": tools,
                "tool_choice": "required", "parallel_tool_calls": False,
                "max_tokens": plan.max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
            }  # fmt: skip
            headers = {"X-Session-ID": f"agent-{i}-task-{task}"} if sessions else {}
            if client_tools:
                step = stream_step(http, url, generic_request(body), headers)
                step.calls = answer_calls(step.text, f"call-{i}-{s}")
                step.valid_calls = sum(
                    valid_json(str(c["arguments"]), SCHEMAS.get(str(c["name"]))) for c in step.calls
                )
            else:
                step = stream_step(http, url, body, headers)
            step.agent, step.step, step.task = i, s, task
            done.append(step)
            size = step.prompt_tokens + step.completion_tokens
            if step.calls:
                calls = [
                    {"id": c["id"], "type": "function",
                     "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in step.calls
                ]  # fmt: skip
                messages = [*messages, {"role": "assistant", "content": None, "tool_calls": calls}]
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": result}
                             for c in step.calls[:1]]  # fmt: skip
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": "ok"}
                             for c in step.calls[1:]]  # fmt: skip
            else:  # no call came back: the text stays, the result comes as the user's
                messages = [*messages, {"role": "assistant", "content": step.text},
                            {"role": "user", "content": result}]  # fmt: skip
            size += result_tokens
        return done

    with httpx.Client(trust_env=False, timeout=TIMEOUT_S, limits=limits) as http:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(plan.agents) as pool:
            for steps in pool.map(agent, range(plan.agents)):
                out.steps += steps
        out.wall_s = time.perf_counter() - t0
    print(f"  {name}: {len(out.steps)} steps in {out.wall_s:.1f} s", flush=True)
    return out


def batch(url: str, prompts: list[list[dict]], body: dict) -> list[Step]:
    """The prompts at once, one thread each, released together."""
    barrier = threading.Barrier(len(prompts))
    limits = httpx.Limits(max_connections=len(prompts) + 2)
    with httpx.Client(trust_env=False, timeout=TIMEOUT_S, limits=limits) as http:

        def one(messages: list[dict]) -> Step:
            barrier.wait(timeout=120)
            full = {"model": MODEL_NAME, "messages": messages, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, **body}  # fmt: skip
            return stream_step(http, url, full, {})

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))


def schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "notes", "schema": schema, "strict": True},
    }


def decode_ratio(url: str, plan: Plan, sizer: Sizer) -> tuple[float, float, list[bool]]:
    """Decode tok/s at batch decode_batch, free and constrained by a json_schema (EOS banned in
    both, the median of `reps` rounds, alternating); and whether each reply to a json_schema
    that lets the reply end (bounded) parsed and validated."""
    prompts = [
        [{"role": "user", "content": f"Notes on {sizer.text(random.Random(k), 60)}"}]
        for k in range(plan.decode_batch)
    ]
    long = {"max_tokens": plan.decode_tokens, "logit_bias": BAN_EOS}
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(plan.reps):
        for constrained in (False, True):
            extra = {"response_format": schema_format(NOTES)} if constrained else {}
            streams = batch(url, prompts, {**long, **extra})
            tokens = sum(s.completion_tokens - 1 for s in streams)
            span = max(s.last for s in streams) - min(s.first for s in streams)
            rates[constrained].append(tokens / span)
    bounded = batch(url, prompts, {"max_tokens": 160, "response_format": schema_format(SHORT)})
    valid = [valid_json(s.text, SHORT) for s in bounded]
    return statistics.median(rates[False]), statistics.median(rates[True]), valid


# -- report -------------------------------------------------------------------------------------


def summary(run: AgentRun, plan: Plan) -> dict[str, float | int | None]:
    later = [s for s in run.steps if s.step >= plan.later_step]
    ttfts = sorted(s.ttft for s in later)
    # An agent acts when its call is whole: the step's latency is request sent -> last token.
    spans = sorted(s.ttft + s.last - s.first for s in later)
    # A client that waits for the whole response (the stream's end) sends the next step then.
    ends = sorted(s.end for s in later)
    prompt = sum(s.prompt_tokens for s in later)
    # Of the history the server had already seen (the step before's prompt and completion, less
    # its last token, which has no KV), the share served from the store: 1.0 is token for token.
    before = {(s.agent, s.task, s.step): s for s in run.steps}
    seen = reused = 0
    for s in later:
        prev = before.get((s.agent, s.task, s.step - 1))
        if prev is not None:
            seen += prev.prompt_tokens + prev.completion_tokens - 1
            reused += min(s.cached_tokens, prev.prompt_tokens + prev.completion_tokens - 1)
    return {
        "later_ttft_mean_ms": 1000 * statistics.fmean(ttfts) if ttfts else None,
        "later_ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        "later_step_latency_mean_ms": 1000 * statistics.fmean(spans) if spans else None,
        "later_step_latency_p90_ms": 1000 * spans[int(0.9 * (len(spans) - 1))] if spans else None,
        "later_step_end_mean_ms": 1000 * statistics.fmean(ends) if ends else None,
        "later_step_end_p90_ms": 1000 * ends[int(0.9 * (len(ends) - 1))] if ends else None,
        "output_tok_s": sum(s.completion_tokens for s in run.steps) / run.wall_s,
        "completion_tokens_mean": statistics.fmean(s.completion_tokens for s in run.steps),
        "prefix_reuse_share": sum(s.cached_tokens for s in later) / prompt if prompt else None,
        "history_reuse_share": reused / seen if seen else None,
        "later_prompt_tokens_mean": prompt / len(later) if later else None,
        "steps": len(run.steps),
        "tool_parse_ok": sum(bool(s.calls) and s.valid_calls == len(s.calls) for s in run.steps)
        / len(run.steps),
        "cut_by_max_tokens": sum(s.finish == "length" for s in run.steps),
        "conversation_resets": run.resets,
    }


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def table(rows: dict[str, dict]) -> str:
    keys = [
        "later_ttft_mean_ms", "later_ttft_p90_ms", "later_step_latency_mean_ms",
        "later_step_latency_p90_ms", "later_step_end_mean_ms", "later_step_end_p90_ms",
        "output_tok_s", "completion_tokens_mean", "prefix_reuse_share",
        "history_reuse_share", "later_prompt_tokens_mean", "steps", "tool_parse_ok",
        "cut_by_max_tokens",
        "conversation_resets",
    ]  # fmt: skip
    lines = [f"{'':26}" + "".join(f"{name:>18}" for name in rows)]
    for key in keys:
        cells = [rows[n].get(key) for n in rows]
        shown = "".join(f"{'-' if v is None else f'{v:.3g}':>18}" for v in cells)
        lines.append(f"{key:26}{shown}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Plan]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="a tiny case (2 agents, 4 steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm", action="store_true", help="also vLLM-CPU (bench/peer_servers.py)")
    p.add_argument("--vllm-scripts", type=Path, default=PEER_SCRIPTS)
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--vllm-model", type=Path, default=None, help="HF directory (config.json)")
    p.add_argument("--no-store-off", action="store_true", help="skip the store-off server")
    p.add_argument(
        "--device-kv-tokens", type=int, default=12288,
        help="both chatstore servers' device KV pool, in tokens at the served dtype (default "
        "1.5 windows: fewer than the agents' histories, as on a server busier than one agent; "
        "0: the server's own default)",
    )  # fmt: skip
    p.add_argument(
        "--vllm-kv-gib", type=int, default=2,
        help="vLLM's KV space (its serve.sh default, 2) and, in a third chatstore run that "
        "agent_ttft_ratio_vs_vllm compares with it, chatstore's device pool",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        plan = Plan(min(args.agents, 2), min(args.steps, 3), 300, 30, 80, 80, 1, 2, 8, args.seed, 1)
    else:
        plan = Plan(args.agents, args.steps, 3000, 200, 2000, 96, 10, 8, 64, args.seed)
    return args, plan


def device_pool_bytes(spec: ModelSpec, tokens: int) -> int:
    """Bytes of a device KV pool of `tokens` tokens at the dtype `dtype = auto` serves here."""
    itemsize = torch.empty(0, dtype=getattr(torch, resolve_dtype("auto"))).element_size()
    return tokens * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * itemsize


def served_dtype(url: str) -> str | None:
    try:
        with httpx.Client(trust_env=False, timeout=10) as http:
            return str(http.get(url + "/admin/cache").json()["engine"]["dtype"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None


def quality(runs: dict[str, AgentRun], notes_valid: list[bool]) -> dict[str, float | None]:
    """Over chatstore's steps (store on and off: the same grammar): every call must parse and
    validate (a step that returned none counts one invalid output), and every json_schema reply."""
    steps = [s for name, run in runs.items() if name != "vllm" for s in run.steps]
    outputs = sum(max(1, len(s.calls)) for s in steps) + len(notes_valid)
    valid = sum(s.valid_calls for s in steps) + sum(notes_valid)
    parsed = sum(1 for s in steps if s.calls and s.valid_calls == len(s.calls))
    return {
        "json_valid_rate": valid / outputs if outputs else None,
        "tool_parse_ok": parsed / len(steps) if steps else None,
    }


def dense_model_dir(path: Path) -> Path | None:
    """`path` when it is a Hugging Face directory vLLM can load (a config.json), else None."""
    return path if (path / "config.json").is_file() else None


def main(argv: list[str] | None = None) -> None:
    args, plan = parse_args(argv)
    from chatstore.config import load_config
    from chatstore.model import load_model

    vllm_ready = args.vllm_scripts.is_dir() and (vllm_venv() / "bin" / "python").is_file()
    if args.vllm and not vllm_ready:
        print(f"--vllm: vLLM is not set up ({args.vllm_scripts}, {vllm_venv()}): skipped")
    print(f"machine: {cpu_model()} ({cpu_isa()})", flush=True)
    model = load_model()
    tokenizer, model_dir = model.tokenizer, model.path
    if args.vllm and vllm_ready and args.vllm_model is None and model.gguf is not None:
        # vLLM loads a Hugging Face directory: the GGUF as transformers reads it (engine_speed's)
        from chatstore.model.hf_export import hf_directory

        model_dir = hf_directory(model.gguf)
    pool_bytes = device_pool_bytes(model.spec, args.device_kv_tokens)
    del model  # the servers load their own copies; the bench keeps only the tokenizer
    sizer = Sizer(tokenizer)
    runs: dict[str, AgentRun] = {}
    result: dict[str, object] = {}
    notes_valid: list[bool] = []
    with tempfile.TemporaryDirectory(prefix="agentic-") as tmp:
        root = Path(tmp)
        peer_model = dense_model_dir(args.vllm_model or model_dir)
        with_vllm = args.vllm and vllm_ready and peer_model is not None
        servers = [("chatstore", True, pool_bytes)]
        servers += [] if args.no_store_off else [("store_off", False, pool_bytes)]
        # Against vLLM, like for like: chatstore's device pool as big as vLLM's KV space.
        servers += [("chatstore_same_kv", True, args.vllm_kv_gib << 30)] if with_vllm else []
        for name, store, kv_bytes in servers:
            (root / name).mkdir()
            server = chatstore_server(root / name / "data", root / name)
            if not store:
                server.argv += ["--kv-store", "off"]
            if kv_bytes:
                server.env["CHATSTORE_KV_CACHE_BYTES"] = str(kv_bytes)
            with server:
                result.setdefault("dtype", served_dtype(server.url))
                runs[name] = run_agents(server.url, plan, sizer, name, sessions=True)
                if name == "chatstore":
                    free, constrained, notes_valid = decode_ratio(server.url, plan, sizer)
                    result["constrained_decode_ratio"] = constrained / free
                    result["decode_tok_s_free"] = free
                    result["decode_tok_s_constrained"] = constrained
            # Its store goes with it (the log stays until the end): at the default 8 agents x 30
            # steps a store-on server writes GBs to its SSD tier, and three such stores at once
            # filled this machine's disk (the server answered 507 store_full, as it should).
            shutil.rmtree(root / name / "data", ignore_errors=True)
        if args.vllm and vllm_ready and peer_model is None:
            print("--vllm: no model directory with a config.json for vLLM (--vllm-model): skipped")
        elif with_vllm and peer_model is not None:
            ensure_vllm(args.vllm_scripts)
            (root / "vllm").mkdir()
            peer = vllm_server(args.vllm_scripts, args.vllm_dtype, peer_model, root / "vllm")
            peer.env["KV_GIB"] = str(args.vllm_kv_gib)
            # The same work as ours: SmolLM2's template drops `tools`, so the client renders
            # the generic form chatstore renders and sends its answer schema; compact JSON, as
            # chatstore's grammar allows (xgrammar's any_whitespace=False there).
            compact = {"backend": "xgrammar", "disable_any_whitespace": True}
            peer.argv += ["--structured-outputs-config", json.dumps(compact)]
            try:
                with peer as srv:
                    runs["vllm"] = run_agents(
                        srv.url, plan, sizer, "vllm", sessions=False, client_tools=True
                    )
            except RuntimeError as exc:  # the peer failed: our side is still reported
                print(f"--vllm: vLLM failed, that side skipped: {exc}")
    rows = {name: summary(run, plan) for name, run in runs.items()}
    print(table(rows))
    ours = rows["chatstore"]["later_ttft_mean_ms"]
    result |= quality(runs, notes_valid)
    result |= {
        "agent_ttft_ratio_vs_store_off": ratio(
            ours, rows.get("store_off", {}).get("later_ttft_mean_ms")
        ),
        "agent_ttft_ratio_vs_vllm": ratio(
            rows.get("chatstore_same_kv", {}).get("later_ttft_mean_ms"),
            rows.get("vllm", {}).get("later_ttft_mean_ms"),
        ),
        "agent_ttft_ratio_vs_vllm_small_pool": ratio(
            ours, rows.get("vllm", {}).get("later_ttft_mean_ms")
        ),
        "agent_step_latency_ratio_vs_store_off": ratio(
            rows["chatstore"]["later_step_latency_mean_ms"],
            rows.get("store_off", {}).get("later_step_latency_mean_ms"),
        ),
        "agent_step_latency_ratio_vs_vllm": ratio(
            rows.get("chatstore_same_kv", {}).get("later_step_latency_mean_ms"),
            rows.get("vllm", {}).get("later_step_latency_mean_ms"),
        ),
        "agent_step_end_ratio_vs_vllm": ratio(
            rows.get("chatstore_same_kv", {}).get("later_step_end_mean_ms"),
            rows.get("vllm", {}).get("later_step_end_mean_ms"),
        ),
        "agent_prefix_reuse_share": rows["chatstore"]["prefix_reuse_share"],
        "agent_history_reuse_share": rows["chatstore"]["history_reuse_share"],
    }
    for name, row in rows.items():
        result |= {f"{name}_{key}": value for key, value in row.items()}
    result |= {
        "cpu": cpu_model(), "isa": cpu_isa(), "weights": str(load_config().weights),
        "agents": plan.agents, "steps": plan.steps, "later_step": plan.later_step,
        "device_kv_tokens": args.device_kv_tokens, "vllm_kv_gib": args.vllm_kv_gib,
        "system_tokens": plan.system_tokens, "result_tokens": [plan.result_min, plan.result_max],
        "vllm": "vllm" in runs,
    }  # fmt: skip
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
