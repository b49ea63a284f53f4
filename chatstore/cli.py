"""`chatstore` command line: `generate` runs the model once; `serve` starts the API; `chat`
talks to a server (or one started in-process with --local) in the terminal."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from chatstore.admin_cli import add_admin_parser, cmd_admin
from chatstore.config import (
    DTYPE_CHOICES,
    PREFILL_WEIGHTS_CHOICES,
    WEIGHTS_CHOICES,
    load_config,
)
from chatstore.keys_cli import add_keys_parser, cmd_keys
from chatstore.model.errors import ModelLoadError


def _common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (defaults: config/default.toml)")
    p.add_argument(
        "--model",
        help="'default' (embedded SmolLM2-135M-Instruct), a HF model dir or a .gguf file",
    )
    p.add_argument(
        "--dtype", choices=DTYPE_CHOICES, help="compute dtype (auto: bf16 where it is fast)"
    )
    p.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        help="projection weights (auto: a GGUF's 4-bit tensors as they are, on CPU)",
    )
    p.add_argument(
        "--prefill-weights",
        choices=PREFILL_WEIGHTS_CHOICES,
        dest="prefill_weights",
        help="quantized weights' prefill: expand just in time, or keep a 16-bit copy (auto: "
        "copy while the copies take <= 1 GiB)",
    )
    p.add_argument("--device", help="cpu, cuda or cuda:N")
    p.add_argument("--block-size", type=int, dest="block_size")
    p.add_argument("--kv-cache-bytes", type=int, dest="kv_cache_bytes")
    p.add_argument("--attention", choices=["auto", "reference"])
    p.add_argument(
        "--kv-layout",
        choices=["paged", "vattention"],
        dest="kv_layout",
        help="device KV layout (vattention: per-request contiguous, pages committed on demand)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatstore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply to one prompt (no server)")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--system", help="system prompt (default: the model's own)")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    _common_flags(gen)
    serve = sub.add_parser("serve", help="start the HTTP API (127.0.0.1:8000 by default)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--log-level", dest="log_level", choices=["debug", "info", "warning", "error"]
    )
    serve.add_argument("--data-dir", dest="data_dir", help="where sessions and KV are kept on disk")
    serve.add_argument(
        "--secret-file",
        dest="secret_key_file",
        help="the master key file (mode 0600, never inside the data dir; docs/security.md)",
    )
    serve.add_argument("--kv-store", dest="kv_store", choices=["on", "off"], help="off = recompute")
    serve.add_argument(
        "--kv-storage-dtype",
        dest="kv_storage_dtype",
        help="stored KV: auto (the compute dtype) | float32 | float16 | bfloat16 | int8",
    )
    serve.add_argument(
        "--redis-url", dest="redis_url", help="remote KV tier, e.g. redis://host:6379/0"
    )
    _common_flags(serve)
    _chat_parser(sub)
    add_admin_parser(sub)
    add_keys_parser(sub)
    return parser


def _chat_parser(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="chat in the terminal with a server (or --local)")
    where = chat.add_mutually_exclusive_group()
    where.add_argument(
        "--url",
        default=os.environ.get("CHATSTORE_URL", "http://127.0.0.1:8000"),
        help="the server (default $CHATSTORE_URL or http://127.0.0.1:8000)",
    )
    where.add_argument(
        "--local", action="store_true", help="start the server in this process (loopback)"
    )
    chat.add_argument(
        "--api-key",
        dest="api_key",
        default=os.environ.get("CHATSTORE_API_KEY"),
        help="sent as Authorization: Bearer (default $CHATSTORE_API_KEY)",
    )
    chat.add_argument("--session", help="resume this session (default: a new one)")
    chat.add_argument("--system", help="system prompt of new sessions")
    chat.add_argument("--max-tokens", type=int, dest="max_tokens", help="reply length cap")
    chat.add_argument("--temperature", type=float)
    local = chat.add_argument_group("--local server options (as for serve)")
    local.add_argument("--data-dir", dest="data_dir", help="where sessions and KV are kept")
    local.add_argument("--kv-store", dest="kv_store", choices=["on", "off"])
    local.add_argument("--redis-url", dest="redis_url")
    local.add_argument(
        "--log-level",
        dest="log_level",
        choices=["debug", "info", "warning", "error"],
        help="the local server's log level (default warning: the terminal is the chat's)",
    )
    _common_flags(local)


def _config_from(args: argparse.Namespace):
    keys = (
        "model", "dtype", "weights", "prefill_weights", "device", "block_size", "kv_cache_bytes",
        "attention", "kv_layout", "host", "port", "log_level", "data_dir", "kv_store", "redis_url",
        "kv_storage_dtype", "secret_key_file",
    )  # fmt: skip
    return load_config(args.config, {k: getattr(args, k, None) for k in keys})


def cmd_generate(args: argparse.Namespace) -> int:
    from chatstore.engine.generate import GenerateOptions, generate
    from chatstore.engine.runtime import create_runtime

    runtime = create_runtime(_config_from(args))
    tok = runtime.model.tokenizer
    if args.raw:
        prompt_ids = tok.encode(args.prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = list(
            tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
    options = GenerateOptions(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        stop_token_ids=runtime.model.spec.eos_token_ids,
    )
    out: list[int] = []
    printed = ""
    start = time.perf_counter()
    for token in generate(runtime.runner, runtime.pool, prompt_ids, options):
        if token in options.stop_token_ids:
            break
        out.append(token)
        text = tok.decode(out, skip_special_tokens=True)
        # Hold back a trailing replacement char: the next token may complete a multi-byte char.
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    elapsed = time.perf_counter() - start
    print(tok.decode(out, skip_special_tokens=True)[len(printed) :])
    print(
        f"[{len(prompt_ids)} prompt tokens, {len(out)} generated, {elapsed:.2f} s]",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from chatstore.server.run import run_server

    return run_server(_config_from(args))


def cmd_chat(args: argparse.Namespace) -> int:
    from chatstore.chat_client import ChatClient, ClientOptions
    from chatstore.terminal_chat import run_chat

    server = None
    if args.local:
        from chatstore.server.in_process import start_in_process

        print("chatstore: starting a local server...", file=sys.stderr, flush=True)
        server = start_in_process(_config_from(args), args.log_level or "warning")
    url = server.url if server is not None else args.url
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    try:
        with ChatClient(ClientOptions(url=url, api_key=args.api_key)) as client:
            return run_chat(client, args.session, args.system, sampling)
    finally:
        if server is not None:
            server.stop()


COMMANDS = {
    "generate": cmd_generate,
    "serve": cmd_serve,
    "chat": cmd_chat,
    "admin": cmd_admin,
    "keys": cmd_keys,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ModelLoadError, ValueError, FileNotFoundError) as exc:
        print(f"chatstore: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside a reply (e.g. while the model loads)
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
