"""`baton` console script: one subcommand per deployable or tool.

Environment variables are read here (and in each service's main) only, never deep in the code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import uuid

from engine.errors import EngineError
from services.common.quantization_flags import add_quantization_args

# Each command's module and the function that registers it. Only the chosen command's module is imported
# (all of them for `baton --help`): the worker's pulls in torch, seconds of start-up and of exit that
# `baton serve` (which never imports torch itself) or `baton status` must not pay.
_COMMANDS: dict[str, tuple[str, str]] = {
    "admin": ("services.gateway.tenancy.admin", "register_admin_commands"),
    "scheduler": ("scheduler.adapters.main", "register_scheduler_command"),
    "bench": ("loadtest.cli", "register_bench_command"),
    "safety": ("services.safety.main", "register_safety_command"),
    "worker": ("services.worker.main", "register_worker_command"),
    "profile": ("services.profiler.main", "register_profile_command"),
    "plan": ("scheduler.adapters.plan_main", "register_plan_command"),
    "serve": ("services.launcher.serve", "register_serve_command"),
    "status": ("services.launcher.status", "register_status_command"),
    "ray": ("services.launcher.ray_main", "register_ray_command"),
    "api": ("services.client.cli", "register_api_command"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_chat(sub)
    first = next(iter(sys.argv[1:] if argv is None else argv), "")
    chosen = [first] if first in _COMMANDS else [] if first in sub.choices else list(_COMMANDS)
    for command in chosen:
        module, register = _COMMANDS[command]
        getattr(importlib.import_module(module), register)(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except EngineError as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF dir or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    add_quantization_args(p)
    p.add_argument("--expert-parallel-size", type=int, default=1,
                   help="MoE models: spread each layer's experts over this many processes (GPUs: rank r "
                        "takes cuda:r), attention replicated")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard every layer over this many processes (gloo on CPU, NCCL on GPU: rank r takes cuda:r)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="split the layers over this many stages, one process (or --tensor-parallel-size "
                        "processes) each; GPUs = tensor x pipeline")
    p.add_argument("--no-pipeline-overlap", action="store_true",
                   help="with --pipeline-parallel-size > 1: one step at a time through the stages (the fallback)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    _engine_args(p)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="raw text prompt")
    group.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: token_ids, text, finish_reason")
    p.set_defaults(func=_cmd_generate)


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat on stdin (multi-turn)")
    _engine_args(p)
    p.set_defaults(func=_cmd_chat, temperature=0.7)


def _build_engine(args: argparse.Namespace):  # noqa: ANN202 - engine import is heavy, keep it lazy
    from engine.config import CacheConfig, EngineConfig, ParallelConfig
    from engine.llm_engine import LLMEngine

    config = EngineConfig(model=args.model or "", dtype=args.dtype, device=args.device,
                          attention_backend=args.attention_backend, quantization=args.quantization,
                          cache=CacheConfig(kv_cache_dtype=args.kv_cache_dtype),
                          parallel=ParallelConfig(expert_parallel_size=args.expert_parallel_size,
                                                  tensor_parallel_size=args.tensor_parallel_size,
                                                  pipeline_parallel_size=args.pipeline_parallel_size,
                                                  pipeline_overlap=not args.no_pipeline_overlap))
    return LLMEngine(config)


def _params(args: argparse.Namespace):  # noqa: ANN202
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed)


def _run_to_end(engine, prompt_ids: list[int], params, on_text=None) -> dict:  # noqa: ANN001
    rid = uuid.uuid4().hex
    engine.add_request(rid, prompt_ids, params)
    token_ids: list[int] = []
    text, reason = "", None
    while reason is None:
        for out in engine.step():
            if out.request_id != rid:
                continue
            token_ids.extend(out.new_token_ids)
            text += out.new_text
            if on_text and out.new_text:
                on_text(out.new_text)
            if out.finish_reason is not None:
                reason = out.finish_reason.value
    return {"token_ids": token_ids, "text": text, "finish_reason": reason}


def _cmd_generate(args: argparse.Namespace) -> int:
    engine = _build_engine(args)
    tok = engine.tokenizer
    if args.chat is not None:
        prompt_ids = tok.encode_chat([{"role": "user", "content": args.chat}])
    else:
        prompt_ids = tok.encode(args.prompt)
    stream = None if args.json else (lambda s: print(s, end="", flush=True))
    try:
        result = _run_to_end(engine, prompt_ids, _params(args), stream)
    finally:
        engine.shutdown()  # parallel followers leave the group with rank 0
    if args.json:
        print(json.dumps(result))
    else:
        print()
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    engine = _build_engine(args)
    try:
        return _chat_loop(engine, args)
    finally:
        engine.shutdown()  # parallel followers leave the group with rank 0


def _chat_loop(engine, args: argparse.Namespace) -> int:  # noqa: ANN001
    tok = engine.tokenizer
    messages: list[dict[str, str]] = []
    print("Baton chat on the local engine. Ctrl-D to quit.", flush=True)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        print("bot> ", end="", flush=True)
        result = _run_to_end(engine, tok.encode_chat(messages), _params(args),
                             lambda s: print(s, end="", flush=True))
        print()
        messages.append({"role": "assistant", "content": result["text"]})


if __name__ == "__main__":
    sys.exit(main())
