"""The command line: `python -m shoal generate "text"` (and `serve`, with the HTTP server)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shoal.api.cache_command import add_cache_parser, run_cache_command
from shoal.api.engine import Engine
from shoal.api.engine_flags import add_engine_flags, engine_options
from shoal.api.http.limits import HttpLimits
from shoal.api.http.reasoning import PARSERS as REASONING_PARSERS
from shoal.api.http.server import Server, ServerOptions
from shoal.api.http.tool_parsers import PARSERS as TOOL_PARSERS
from shoal.api.port_check import check_can_listen
from shoal.api.sampling_wire import add_sampling_flags, sampling_from_args
from shoal.kernels.cache_files import StartCancelled

HTTP_LIMITS = HttpLimits.__struct_fields__  # --max-json-depth ... on serve
# What stops `serve`, during the start-up (cancelled) and after (open streams ended cleanly).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def add_engine_options(parser: argparse.ArgumentParser, command: str) -> None:
    """--model (a path: its own handling), then a flag per EngineOptions field."""
    parser.add_argument(
        "--model",
        default=None,
        help="HF folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
    add_engine_flags(parser, command)


def engine_from_args(args: argparse.Namespace, peer_key: str | None = None) -> Engine:
    """The engine the flags ask for: EngineOptions built in one place (engine_options).
    `peer_key`: serve's --api-key, which disaggregation's bootstrap calls carry too."""
    return Engine(args.model, peer_key=peer_key, **asdict(engine_options(args)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shoal", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument(
        "--raw", action="store_true", help="send the text as is instead of as a chat message"
    )
    add_sampling_flags(gen, temperature=0.0)  # the terminal's answer: greedy unless asked
    add_engine_options(gen, "generate")
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible and native HTTP API")
    server_defaults = ServerOptions()
    serve.add_argument("--host", default=server_defaults.host)
    serve.add_argument("--port", type=int, default=server_defaults.port, help="0: pick a free one")
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    serve.add_argument(
        "--admin-api-key",
        default=None,
        help="the lifecycle routes (update_weights_from_disk, flush_cache, pause / continue "
        "generation, abort_request) then need Authorization: Bearer ADMIN_KEY",
    )
    serve.add_argument(
        "--allow-pickled-weights",
        action="store_true",
        help="serve POST /update_weights_from_tensor, whose body is a pickle: unpickling runs "
        "code the sender chooses, so it needs --admin-api-key and takes only that key",
    )
    serve.add_argument(
        "--allowed-origins",
        type=_origins,
        default=server_defaults.allowed_origins,
        help="comma-separated browser origins (scheme://host:port) allowed besides the "
        "server's own; '*': any. Other Origin headers answer 403",
    )
    serve.add_argument(
        "--allowed-hosts",
        type=_origins,
        default=server_defaults.allowed_hosts,
        help="comma-separated host names the server is reached by, besides IP addresses, "
        "localhost and --host ('.example.com': it and every name under it; '*': any). "
        "Other Host headers answer 403 (a guard against DNS rebinding)",
    )
    serve.add_argument(
        "--body-timeout-s",
        type=float,
        default=server_defaults.body_timeout_s,
        help="a request body not fully read by then answers 408",
    )
    serve.add_argument(
        "--header-timeout-s",
        type=float,
        default=server_defaults.header_timeout_s,
        help="close a connection whose request head is not complete by then (also the idle "
        "keep-alive limit)",
    )
    serve.add_argument(
        "--max-header-bytes",
        type=int,
        default=server_defaults.max_header_bytes,
        help="the request line and each header line: longer answers 400",
    )
    serve.add_argument("--max-headers", type=int, default=server_defaults.max_headers)
    serve.add_argument(
        "--stream-write-timeout-s",
        type=float,
        default=server_defaults.stream_write_timeout_s,
        help="cut a streaming client (SSE, session websocket) that reads nothing for this "
        "long, and abort its requests",
    )
    serve.add_argument(
        "--sse-keepalive-s",
        type=float,
        default=server_defaults.sse_keepalive_s,
        help="send an SSE comment (': keep-alive') after this long without an event; 0: never",
    )
    serve.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="/generate stream events carry only the text, ids and logprobs new since the "
        "previous event (SGLang's flag), not everything so far",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the format tool calls are read in for tool_choice auto (default: the one the "
        "model's chat template shows, if any)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split a reasoning model's <think> block into reasoning_content (default: none)",
    )
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-body-bytes", type=int, default=server_defaults.max_body_bytes)
    serve.add_argument(
        "--max-queued-requests", type=int, default=server_defaults.max_queued_requests
    )
    serve.add_argument("--max-n", type=int, default=server_defaults.max_n)
    http_limits = serve.add_argument_group("input limits, HTTP (docs/limits.md)")
    for name in HTTP_LIMITS:
        flag = "--" + name.replace("_", "-")
        http_limits.add_argument(flag, type=int, default=getattr(server_defaults, name))
    add_engine_options(serve, "serve")
    add_cache_parser(commands)
    return parser


async def generate(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    async with engine_from_args(args) as engine:
        ready = time.perf_counter()
        kwargs = (
            {"prompt": args.prompt}
            if args.raw
            else {"messages": [{"role": "user", "content": args.prompt}]}
        )
        stream = engine.generate(**kwargs, sampling=sampling_from_args(args))
        async for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        done = await stream.result()
        took = time.perf_counter() - ready
        sys.stdout.write("\n")
        prompt = done.prompt_logprobs  # --logprob-start-len N
        if prompt is not None and prompt.first_token_id is not None:
            print(f"[prompt token {prompt.first_token_id}: no logprob]", file=sys.stderr)
        items = [("prompt token", t) for t in (prompt.items if prompt is not None else ())]
        items += [("token", t) for t in done.logprobs or ()]  # --logprobs / --top-logprobs N
        for what, item in items:
            listed = f"; listed {list(item.listed)}" if item.listed else ""  # --token-ids-logprob
            print(
                f"[{what} {item.token_id}: {item.logprob:.4f}; top {list(item.top)}{listed}]",
                file=sys.stderr,
            )
        if done.routed_experts is not None:  # --return-routed-experts: SGLang's base64
            routed = base64.b64encode(done.routed_experts).decode("ascii")
            print(f"[routed experts, int32 [positions, layers, top_k]: {routed}]", file=sys.stderr)
        print(
            f"[{done.finish_reason}; {done.usage.completion_tokens} tokens in {took:.2f}s "
            f"({done.usage.completion_tokens / max(took, 1e-9):.1f} tok/s); "
            f"engine ready in {ready - began:.2f}s]",
            file=sys.stderr,
        )
    return 0


async def serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM / SIGHUP, then end open streams with an error event and
    exit 0; one of them during the start-up cancels it (the conversion or the kernel build
    stops and removes what it wrote) and exits 0 within seconds."""
    options = ServerOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        allow_pickled_weights=args.allow_pickled_weights,
        allowed_origins=args.allowed_origins,
        allowed_hosts=args.allowed_hosts,
        body_timeout_s=args.body_timeout_s,
        header_timeout_s=args.header_timeout_s,
        max_header_bytes=args.max_header_bytes,
        max_headers=args.max_headers,
        stream_write_timeout_s=args.stream_write_timeout_s,
        sse_keepalive_s=args.sse_keepalive_s,
        incremental_streaming_output=args.incremental_streaming_output,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        served_model_name=args.served_model_name or _model_name(args.model),
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
        max_n=args.max_n,
        **{name: getattr(args, name) for name in HTTP_LIMITS},
    )
    options.validate()
    engine = engine_from_args(args, peer_key=args.api_key)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:  # during the start too: it is cancelled (Engine.cancel_start)
        loop.add_signal_handler(sig, _stop, stop, engine, sig)
    await check_can_listen(args.host, args.port)  # before the model loads
    try:
        async with engine, Server(engine, options) as server:
            print(
                f"shoal serving {server.model_names[0]} at {server.url} "
                f"(engine ready in {engine.startup_s:.1f}s)",
                flush=True,
            )
            resolved = engine.resolved
            assert resolved is not None  # started
            print(resolved.start_report(engine.attention), flush=True)  # kernels, scheduling
            await stop.wait()
            print("shoal: shutting down", file=sys.stderr, flush=True)
    except StartCancelled:
        print("shoal: start-up cancelled, exiting", file=sys.stderr, flush=True)
    return 0


def _stop(stop: asyncio.Event, engine: Engine, sig: signal.Signals) -> None:
    if not stop.is_set():
        print(f"shoal: {sig.name} received", file=sys.stderr, flush=True)
    stop.set()
    engine.cancel_start()


def _origins(text: str) -> tuple[str, ...]:
    """--allowed-origins "http://a:8080, https://b" -> ("http://a:8080", "https://b"); the
    same split for --allowed-hosts."""
    return tuple(entry.strip() for entry in text.split(",") if entry.strip())


def _model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def _run(coro: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("shoal.startup").setLevel(logging.INFO)  # kernel build progress, waits
    args = build_parser().parse_args(argv)
    if args.command == "cache":
        return run_cache_command(args)
    if args.command == "generate":
        try:
            return asyncio.run(generate(args))
        except (ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.command == "serve":
        try:
            return _run(serve(args))
        except (ValueError, FileNotFoundError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 2
