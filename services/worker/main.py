"""`baton worker`: a prefill, decode or co-located (`both`) gRPC worker around one engine.

Flags win over `BATON_WORKER_*` environment variables (read here only), which win over defaults:
BATON_WORKER_SCHEDULER, BATON_WORKER_METRICS_PORT, BATON_WORKER_PREFILL_PEERS (comma-separated).
Prints `BATON_WORKER_READY port=<port>` on stdout once gRPC health is SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvtransfer.faults import FaultConfig
from services.common.cluster_auth import ClusterToken
from services.common.quantization_flags import add_quantization_args
from services.common.tracing import EXPORTERS, setup_tracing
from services.worker.config import DisaggPolicy, TransferConfig, WorkerConfig, WorkerRole

if TYPE_CHECKING:  # the engine is imported in main only, after the flags are read
    from engine.parallel.launcher import RankServiceFactory

log = logging.getLogger("services.worker")
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def register_worker_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `worker` to the `baton` CLI (services/cli.py)."""
    parser = subparsers.add_parser("worker", help="run a prefill / decode / both gRPC worker")
    add_worker_args(parser)
    parser.set_defaults(func=run_worker_command)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--role", required=True, choices=[r.value for r in WorkerRole])
    p.add_argument("--model", default="", help="HF dir or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model-id", default="", help="served model name, compared in the KV handshake")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--advertise-address", default="", help="host:port for peers and the scheduler")
    p.add_argument("--worker-id", default="")
    p.add_argument("--scheduler", default=env("BATON_WORKER_SCHEDULER", ""), help="scheduler host:port")
    p.add_argument("--metrics-port", type=int, default=_int_or_none(env("BATON_WORKER_METRICS_PORT")))
    p.add_argument("--prefill-peers", default=env("BATON_WORKER_PREFILL_PEERS", ""),
                   help="decode role: comma-separated prefill workers (host:port)")
    add_engine_args(p)
    _disagg_args(p)
    p.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    p.add_argument("--drain-grace-s", type=float, default=20.0)
    p.add_argument("--allow-fault-injection", action="store_true", help="enable the InjectFault RPC (tests)")
    p.add_argument("--log-level", default="INFO")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="dummy: random weights from --model's config.json alone (benchmarks)")
    p.add_argument("--seed", type=int, default=0,
                   help="engine seed: dummy weights (same seed, same weights) and unseeded sampling")
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    add_quantization_args(p)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prefill-chunk", type=int, default=512)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--torch-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--speculative-ngram", type=int, default=0, metavar="K",
                   help="n-gram speculative decoding: verify up to K prompt-lookup draft tokens per decode step "
                        "for requests that do not set their own (0: off unless a request asks)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks of the engine, one process (and GPU: rank r takes cuda:r) each; "
                        "prefill and decode peers must use the same size")
    p.add_argument("--expert-parallel-size", type=int, default=1,
                   help="MoE models: ranks that each hold 1/N of every MoE layer's experts, one process (and "
                        "GPU) each; attention is replicated; --role both only; not with --tensor-parallel-size")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="split the layers over this many stages of --tensor-parallel-size ranks each "
                        "(GPUs = tensor x pipeline); a prefill worker's stages each hand their layers' KV to "
                        "the decode worker (same stage count, or fewer decode stages whose layers contain them)")
    p.add_argument("--no-pipeline-overlap", action="store_true",
                   help="with --pipeline-parallel-size > 1: run one step at a time through the stages, in "
                        "micro-batches, instead of one batch in flight per stage (the fallback)")
    _kv_tier_args(p)


def _kv_tier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-kv-gib", type=float, default=0.0,
                   help="pinned host memory for KV blocks evicted from the GPU pool (0: off); a prompt whose "
                        "prefix is found there loads it instead of prefilling it")
    p.add_argument("--disk-kv-dir", default="", help="directory of the disk KV tier (emptied at start-up)")
    p.add_argument("--disk-kv-gib", type=float, default=0.0,
                   help="disk space for KV blocks evicted from host memory (0: off; needs --disk-kv-dir)")
    p.add_argument("--kv-load-min-speedup", type=float, default=1.0,
                   help="load a block from host/disk only when its measured load time beats its measured "
                        "recompute time by this factor (0: always load)")


def _disagg_args(p: argparse.ArgumentParser) -> None:
    d, t = DisaggPolicy(), TransferConfig()
    p.add_argument("--min-remote-prompt-tokens", type=int, default=d.min_remote_prompt_tokens)
    p.add_argument("--min-remote-uncached-tokens", type=int, default=d.min_remote_uncached_tokens)
    p.add_argument("--max-cached-fraction", type=float, default=d.max_cached_fraction)
    p.add_argument("--prefill-timeout-s", type=float, default=t.prefill_timeout_s)
    p.add_argument("--transfer-timeout-s", type=float, default=t.transfer_timeout_s)
    p.add_argument("--kv-quarantine-s", type=float, default=t.quarantine_s)
    p.add_argument("--kv-checksums", action=argparse.BooleanOptionalAction, default=t.checksums)
    p.add_argument("--notice-grace-s", type=float, default=t.notice_grace_s)
    p.add_argument("--peer-down-s", type=float, default=t.peer_down_s,
                   help="skip a prefill worker this long after a transport failure")
    p.add_argument("--nixl-progress-thread", action=argparse.BooleanOptionalAction, default=t.progress_thread,
                   help="NIXL's progress thread per agent (default: on when the KV cache is on a GPU; about "
                        "half a core each; see TransferConfig)")
    p.add_argument("--otel-exporter", choices=EXPORTERS, default="none",
                   help="OpenTelemetry spans of every RPC, continuing the caller's trace (otlp: OTEL_EXPORTER_OTLP_*)")
    p.add_argument("--gil-switch-interval-ms", type=float, default=0.1,
                   help="sys.setswitchinterval: how long a thread may hold the GIL while another waits "
                        "(Python's default 5 ms delays every hand-off hop and every torch call of the engine "
                        "thread behind the event loop)")
    p.add_argument("--nixl-threads", type=int, default=t.nixl_threads,
                   help="UCX worker threads per NIXL agent (0: NIXL's default)")
    p.add_argument("--kv-stream", action=argparse.BooleanOptionalAction, default=t.stream_kv,
                   help="prefill: write each chunk's full KV blocks while the next chunk computes")
    p.add_argument("--overlap-reserve", action=argparse.BooleanOptionalAction, default=t.overlap_reserve,
                   help="decode: send the Prefill RPC before reserving the blocks; they follow once reserved")
    p.add_argument("--kv-stream-min-prompt-tokens", type=int, default=t.stream_min_prompt_tokens,
                   help="prefill: stream the KV of prompts at least this long (shorter: one WRITE)")


def build_worker_config(args: argparse.Namespace) -> WorkerConfig:
    peers = tuple(a.strip() for a in args.prefill_peers.split(",") if a.strip())
    return WorkerConfig(
        role=WorkerRole(args.role),
        model_id=args.model_id or (Path(args.model).name if args.model else DEFAULT_MODEL_ID),
        host=args.host, port=args.port, advertise_address=args.advertise_address, worker_id=args.worker_id,
        scheduler_address=args.scheduler, metrics_port=args.metrics_port, prefill_peers=peers,
        heartbeat_interval_s=args.heartbeat_interval_s, drain_grace_s=args.drain_grace_s,
        tensor_parallel_size=args.tensor_parallel_size, expert_parallel_size=args.expert_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        allow_fault_injection=args.allow_fault_injection, faults=FaultConfig(),
        policy=DisaggPolicy(args.min_remote_prompt_tokens, args.min_remote_uncached_tokens,
                            args.max_cached_fraction),
        transfer=TransferConfig(prefill_timeout_s=args.prefill_timeout_s,
                                transfer_timeout_s=args.transfer_timeout_s,
                                quarantine_s=args.kv_quarantine_s, checksums=args.kv_checksums,
                                notice_grace_s=args.notice_grace_s, peer_down_s=args.peer_down_s,
                                progress_thread=args.nixl_progress_thread, nixl_threads=args.nixl_threads,
                                stream_kv=args.kv_stream, stream_min_prompt_tokens=args.kv_stream_min_prompt_tokens,
                                overlap_reserve=args.overlap_reserve),
        cluster_token=ClusterToken.from_environ(os.environ),
    )


def build_engine_config(args: argparse.Namespace):  # noqa: ANN201 - engine import is heavy, keep it lazy
    from engine.config import BatcherConfig, CacheConfig, EngineConfig, ParallelConfig, SpeculativeConfig
    from engine.kv_tiers.types import TierConfig

    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        load_format=args.load_format, seed=args.seed, max_model_len=args.max_model_len,
        quantization=args.quantization,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          enable_prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype),
        batcher=BatcherConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              max_prefill_chunk=args.max_prefill_chunk),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                expert_parallel_size=args.expert_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                pipeline_overlap=not args.no_pipeline_overlap),
        speculative=SpeculativeConfig(num_draft_tokens=args.speculative_ngram),
        tiers=TierConfig.from_gib(args.host_kv_gib, args.disk_kv_dir, args.disk_kv_gib, args.kv_load_min_speedup),
    )


def run_worker_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    try:
        config = build_worker_config(args)
    except ValueError as e:
        print(f"baton worker: error: {e}", file=sys.stderr)
        return 2
    import torch

    from engine.errors import EngineError
    from engine.llm_engine import LLMEngine

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    # Three threads share the GIL: the engine thread, the event loop (RPCs, hand-off notices and commits,
    # token streams) and the KV link. Each hop of a hand-off waits for the GIL up to the switch interval
    # (a polling thread measured 17.5 ms per 1 ms poll beside a busy engine at 5 ms, 1.9 ms at 0.5 ms),
    # and so does the engine thread after every torch call, which releases it: on a 4xH200 decode worker
    # fed by three prefill workers, 0.1 ms instead of 1 ms cut its decode steps from ~17 to ~13 ms mean
    # (docs/benchmarks.md, "The TPOT <= 50 pairs with four gateway processes").
    sys.setswitchinterval(args.gil_switch_interval_ms / 1e3)
    if args.otel_exporter != "none":
        setup_tracing(args.otel_exporter, f"baton-worker-{config.role.value}")
    if args.device.startswith("cuda"):
        from engine.kernels.compile_log import log_triton_compiles

        log_triton_compiles()
    try:  # load before serving: health turns SERVING after
        engine = LLMEngine(build_engine_config(args), rank_service=_rank_service(config))
    except EngineError as e:
        print(f"baton worker: error: {e}", file=sys.stderr)
        return 2
    asyncio.run(_serve(config, engine))
    return 0


def _rank_service(config: WorkerConfig) -> RankServiceFactory | None:
    """With tensor or pipeline parallelism and NIXL, every follower rank gets a NIXL agent over its KV shard."""
    if not config.uses_nixl or config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        return None
    from kvtransfer.nixl.shards import ShardAgentFactory

    return ShardAgentFactory(config.worker_id or config.role.value, config.model_id,
                             poll_idle_s=config.transfer.poll_idle_s, poll_busy_s=config.transfer.poll_busy_s,
                             progress_thread=config.transfer.progress_thread, num_threads=config.transfer.nixl_threads)


async def _serve(config: WorkerConfig, engine: object) -> None:
    from services.worker.server import WorkerServer

    server = WorkerServer(config, engine)  # type: ignore[arg-type]
    port = await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
    print(f"BATON_WORKER_READY port={port}", flush=True)
    await server.wait_closed()


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton worker", description=__doc__)
    add_worker_args(parser)
    return run_worker_command(parser.parse_args(argv))
