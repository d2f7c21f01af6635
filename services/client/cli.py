"""`baton api chat` / `baton api complete`: one completion over the internal gRPC API, streamed to stdout.

The key comes from `--api-key` or `BATON_API_KEY`, the address from `--target` or `BATON_GRPC_TARGET`
(default 127.0.0.1:8001, where `baton serve` puts the API). Exit status: 0 served (a content-policy
refusal too: its reason goes to stderr), 2 refused with an error (printed with its gRPC status).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterator

from services.client.client import BatonClient
from services.client.types import BatonApiError, Chunk, Completion, Message, Role, Sampling

DEFAULT_TARGET = "127.0.0.1:8001"


def register_api_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("api", help="call a running gateway's internal gRPC API")
    sub = p.add_subparsers(dest="api_command", required=True)
    chat = sub.add_parser("chat", help="a chat completion of one user message")
    chat.add_argument("message")
    chat.add_argument("--system", default=None, help="a system message before it")
    chat.set_defaults(func=_run, kind="chat")
    complete = sub.add_parser("complete", help="a text completion of a raw prompt")
    complete.add_argument("prompt")
    complete.set_defaults(func=_run, kind="complete")
    for command in (chat, complete):
        _common_args(command)


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=os.environ.get("BATON_GRPC_TARGET", DEFAULT_TARGET), help="host:port")
    p.add_argument("--api-key", default=os.environ.get("BATON_API_KEY"), help="default: BATON_API_KEY")
    p.add_argument("--model", default=None, help="default: the default model's name")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--tls", action="store_true", help="TLS, verified against the system's roots")
    p.add_argument("--ca-cert", default=None, help="TLS, verified against this PEM certificate")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")


def _run(args: argparse.Namespace) -> int:
    if not args.api_key:
        print("baton api: error: no API key: pass --api-key or set BATON_API_KEY", file=sys.stderr)
        return 2
    sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                        stop=tuple(args.stop))
    extra = {"model": args.model} if args.model else {}
    with BatonClient(args.target, args.api_key, tls=args.tls, ca_cert=args.ca_cert, **extra) as client:
        try:
            result = Completion.collect(_echo(_chunks(client, args, sampling), not args.json))
        except BatonApiError as e:
            print(f"\nbaton api: error: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(result), default=lambda b: list(b)))
    else:
        print()
    if result.choices and result.choices[0].refusal:
        print(f"baton api: refused: {result.choices[0].refusal}", file=sys.stderr)
    return 0


def _chunks(client: BatonClient, args: argparse.Namespace, sampling: Sampling) -> Iterator[Chunk]:
    if args.kind == "complete":
        return client.stream_complete(args.prompt, sampling=sampling)
    messages = [Message(Role.SYSTEM, args.system)] if args.system else []
    return client.stream_chat([*messages, Message(Role.USER, args.message)], sampling=sampling)


def _echo(chunks: Iterator[Chunk], show: bool) -> Iterator[Chunk]:
    for chunk in chunks:
        if show and chunk.text:
            print(chunk.text, end="", flush=True)
        yield chunk
