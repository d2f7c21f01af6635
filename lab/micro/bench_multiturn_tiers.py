"""Multi-turn conversations with the KV tiers (host memory, disk) on and off, in one run.

    python -m lab.micro.bench_multiturn_tiers --smoke            # CPU, default model, < 1 min (CI)
    python -m lab.micro.bench_multiturn_tiers --model <8B dir> --load-format dummy --device cuda \
        --dtype bfloat16 --attention-backend triton --num-blocks 4096 --conversations 48 --turns 8 \
        --first-turn-tokens 1024 --turn-tokens 896 --answer-tokens 128 --host-kv-gib 48 \
        --disk-kv-dir /tmp/baton-kv --disk-kv-gib 32 --time-limit-s 540 --out results/multiturn_h200.json

Every conversation re-sends its whole history each turn (as Baton's stored conversations do): turn t's
prompt is turn t-1's prompt, its answer and `--turn-tokens` new tokens, so with the GPU preset the
history grows past 8k tokens by turn 8. All conversations are live at once and together hold more KV
than the GPU pool (`--num-blocks`), so without tiers a turn finds its history evicted and prefills it
again; with tiers it loads it from host memory or disk. Each mode runs the same workload on a fresh
engine in this process, plus a 0%-hit phase (unique single-turn prompts) that shows what the tiers
cost when nothing is ever reused (demotion copies on eviction). Greedy outputs of the two modes are
compared turn by turn.

Reported per mode: TTFT p50 of later turns split by where their history came from ("hit": at least
half of it was served by the GPU prefix cache or a tier; "from tier": at least half of it was loaded
from host memory or disk; "recompute": none of it was served), goodput (turns meeting TTFT <=
--ttft-slo-ms and TPOT <= --tpot-slo-ms, per second), output throughput and TPOT p50/p99, and for the
0%-hit phase throughput and TPOT, and per phase the engine thread's time inside the tier store's hooks
(lab/micro/tier_hook_timer.py). `--zero-hit-host-only-kv-gib` adds a third engine ("host_only") that runs
only the 0%-hit phase with a host tier of that size and no disk, small enough to fill: the host tier's
cost apart from the disk's. `--time-limit-s` is a hard limit on the whole run: the phases get
shares of it, a phase past its share is cut (its remaining requests aborted, `truncated` set), and a
watchdog kills the process 60 s after the limit whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.config import BatcherConfig, CacheConfig, EngineConfig
from engine.kv_tiers.types import TierConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from lab.micro.tier_hook_timer import HookTimer

_GIB = 1024**3


@dataclass(frozen=True)
class Workload:
    conversations: int  # live at once
    turns: int
    first_turn_tokens: int
    turn_tokens: int  # new user tokens per later turn
    answer_tokens: int  # generated per turn (EOS ignored)
    unique_prompts: int  # 0%-hit phase: single-turn prompts of first_turn_tokens, none shared
    probes: int = 3  # idle probes of a turn whose history left the GPU pool
    probe_history_tokens: int = 8192
    seed: int = 0


@dataclass(frozen=True)
class TurnRecord:
    conversation: int
    turn: int  # 1-based; the 0%-hit phase uses turn 0
    prompt_tokens: int
    history_tokens: int  # tokens of earlier turns in the prompt (what a cache or tier may serve)
    cached_tokens: int  # prompt tokens served by the GPU prefix cache or a lower tier
    tier_loaded_tokens: int  # of those, loaded from host memory or disk
    ttft_s: float
    tpot_s: float | None  # None with a single output token
    output: tuple[int, ...]


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


async def _turn(engine: AsyncEngine, rid: str, prompt: list[int],
                answer_tokens: int) -> tuple[float, float | None, tuple[int, int], list[int]]:
    """(TTFT, TPOT, (cached tokens, of which loaded from a tier), output ids) of one request."""
    params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first = last = None
    out: list[int] = []
    cached = (0, 0)
    async for o in engine.generate(prompt, params, rid):
        now = time.perf_counter()
        first = first if first is not None else now
        last = now
        out.extend(o.new_token_ids)
        cached = (o.num_cached_tokens, o.num_tier_loaded_tokens)
    assert first is not None and last is not None
    tpot = (last - first) / (len(out) - 1) if len(out) > 1 else None
    return first - start, tpot, cached, out


async def _conversation(engine: AsyncEngine, w: Workload, index: int, vocab: int, mode: str,
                        records: list[TurnRecord]) -> None:
    rng = random.Random(w.seed * 7919 + index)
    history: list[int] = []
    for turn in range(1, w.turns + 1):
        prompt = history + _tokens(rng, w.first_turn_tokens if turn == 1 else w.turn_tokens, vocab)
        ttft, tpot, cached, out = await _turn(engine, f"{mode}-c{index}-t{turn}", prompt, w.answer_tokens)
        records.append(TurnRecord(index, turn, len(prompt), len(history), *cached, ttft, tpot, tuple(out)))
        history = prompt + out


async def _unique(engine: AsyncEngine, w: Workload, vocab: int, mode: str, records: list[TurnRecord]) -> None:
    async def one(i: int) -> None:
        prompt = _tokens(random.Random(10**6 + w.seed * 7919 + i), w.first_turn_tokens, vocab)
        ttft, tpot, cached, out = await _turn(engine, f"{mode}-u{i}", prompt, w.answer_tokens)
        records.append(TurnRecord(i, 0, len(prompt), 0, *cached, ttft, tpot, tuple(out)))

    await asyncio.gather(*(one(i) for i in range(w.unique_prompts)))


async def _probe(engine: AsyncEngine, w: Workload, vocab: int, mode: str, pool_tokens: int,
                 records: list[TurnRecord]) -> None:
    """Idle TTFT of a turn whose `probe_history_tokens` of history have left the GPU pool: the history is
    prefilled once, unique filler prompts (more tokens than the pool holds) evict it, then the history plus
    64 new tokens is sent alone. Tiers off: the history is recomputed; on: it comes back from a tier."""
    for i in range(w.probes):
        rng = random.Random(2 * 10**6 + w.seed * 7919 + i)
        history = _tokens(rng, w.probe_history_tokens, vocab)
        await _turn(engine, f"{mode}-p{i}-history", history, 1)
        fillers = pool_tokens // w.first_turn_tokens + 2
        await asyncio.gather(*(_turn(engine, f"{mode}-p{i}-fill{j}", _tokens(rng, w.first_turn_tokens, vocab), 1)
                               for j in range(fillers)))
        prompt = history + _tokens(rng, 64, vocab)
        ttft, tpot, cached, out = await _turn(engine, f"{mode}-p{i}", prompt, 16)
        records.append(TurnRecord(i, -1, len(prompt), len(history), *cached, ttft, tpot, tuple(out)))


async def _phase(coros: list, budget_s: float) -> tuple[float, bool]:  # type: ignore[type-arg]
    """Run coroutines concurrently within `budget_s`; returns (seconds, truncated)."""
    start = time.perf_counter()
    tasks = [asyncio.ensure_future(c) for c in coros]
    done, pending = await asyncio.wait(tasks, timeout=max(budget_s, 1.0))
    for task in pending:
        task.cancel()  # the engine aborts a request whose stream is abandoned
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()
    return time.perf_counter() - start, bool(pending)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(records: list[TurnRecord], seconds: float, ttft_slo_s: float, tpot_slo_s: float,
              block_size: int) -> dict[str, object]:
    later = [r for r in records if r.turn >= 2]
    hit = [r.ttft_s for r in later if r.cached_tokens * 2 >= r.history_tokens]
    from_tier = [r.ttft_s for r in later if r.tier_loaded_tokens * 2 >= r.history_tokens]
    recompute = [r.ttft_s for r in later if r.cached_tokens < block_size]
    good = [r for r in records if r.ttft_s <= ttft_slo_s and (r.tpot_s is None or r.tpot_s <= tpot_slo_s)]
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    return {
        "requests": len(records), "seconds": seconds,
        "ttft_p50_later_turns_s": _pct([r.ttft_s for r in later], 0.5),
        "ttft_p50_history_hit_s": _pct(hit, 0.5), "history_hit_turns": len(hit),
        "ttft_p50_history_from_tier_s": _pct(from_tier, 0.5), "history_from_tier_turns": len(from_tier),
        "ttft_p50_history_recomputed_s": _pct(recompute, 0.5), "history_recomputed_turns": len(recompute),
        "goodput_req_s": len(good) / seconds if seconds else 0.0,
        "slo_attainment": len(good) / len(records) if records else 0.0,
        "output_tok_s": sum(len(r.output) for r in records) / seconds if seconds else 0.0,
        "tpot_p50_s": _pct(tpots, 0.5), "tpot_p99_s": _pct(tpots, 0.99),
        "cached_prompt_fraction": sum(r.cached_tokens for r in records) / max(1, sum(r.prompt_tokens for r in records)),
    }


def _probe_summary(records: list[TurnRecord]) -> dict[str, object]:
    return {"probes": len(records), "history_tokens": [r.history_tokens for r in records],
            "tier_loaded_tokens": [r.tier_loaded_tokens for r in records],
            "cached_tokens": [r.cached_tokens for r in records],
            "ttft_s": [r.ttft_s for r in records], "ttft_p50_s": _pct([r.ttft_s for r in records], 0.5)}


async def _history_phases(aengine: AsyncEngine, w: Workload, vocab: int, mode: str, pool_tokens: int,
                          budget_s: float, slo: tuple[float, float], block_size: int,
                          timer: HookTimer) -> tuple[dict[str, object], float]:
    """The probe and the conversations; returns their report and the seconds they took."""
    probe: list[TurnRecord] = []
    probe_s, probe_cut = await _phase([_probe(aengine, w, vocab, mode, pool_tokens, probe)],
                                      min(90.0, budget_s * 0.25))
    probe_hooks = timer.take()
    conv: list[TurnRecord] = []
    conv_s, conv_cut = await _phase([_conversation(aengine, w, i, vocab, mode, conv)
                                     for i in range(w.conversations)], (budget_s - probe_s) * 0.8)
    return {"conversations": summarize(conv, conv_s, *slo, block_size), "conversations_truncated": conv_cut,
            "probe": _probe_summary(probe), "probe_truncated": probe_cut,
            "engine_thread": {"probe": probe_hooks.as_dict(), "conversations": timer.take().as_dict()},
            "_records": [asdict(r) for r in conv]}, probe_s + conv_s


async def _run_mode(config: EngineConfig, w: Workload, mode: str, budget_s: float,
                    slo: tuple[float, float], zero_hit_only: bool = False) -> dict[str, object]:
    """One engine: the probe, the conversations and the 0%-hit phase (only the last: `zero_hit_only`)."""
    engine = LLMEngine(config)
    timer = HookTimer(engine)
    vocab = engine.model_config.vocab_size
    block_size = config.cache.block_size
    aengine = AsyncEngine(engine)
    try:
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in aengine.generate(_tokens(random.Random(-1), 32, vocab), warm, f"{mode}-warm"):
            pass
        timer.take()
        report: dict[str, object] = {"engine_thread": {}}
        if not zero_hit_only:
            report, used_s = await _history_phases(aengine, w, vocab, mode, config.cache.num_blocks * block_size,
                                                   budget_s, slo, block_size, timer)
            budget_s -= used_s  # at least 20% of what the probe left
        uniq: list[TurnRecord] = []
        uniq_s, uniq_cut = await _phase([_unique(aengine, w, vocab, mode, uniq)], budget_s)
        report["engine_thread"]["zero_hit"] = timer.take().as_dict()  # type: ignore[index]
        tiers = await aengine.tier_stats()
    finally:
        aengine.shutdown()
    return {
        **report, "zero_hit": summarize(uniq, uniq_s, *slo, block_size), "zero_hit_truncated": uniq_cut,
        "tiers": None if tiers is None else {
            "hit_blocks": {t.value: n for t, n in tiers.hit_blocks.items()},
            "demoted_blocks": {t.value: n for t, n in tiers.demoted_blocks.items()},
            "fallbacks": {r.value: n for r, n in tiers.fallbacks.items()},
            "skipped_slower_than_recompute": tiers.skipped_slower_than_recompute,
            "spills_dropped": tiers.spills_dropped},
    }


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="CPU preset for CI: default model, 16-block pool, 5 conversations of 8 short turns")
    ap.add_argument("--model", default="", help="HF dir, .gguf, or config.json dir with --load-format dummy "
                                                "(default: the default model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--num-blocks", type=int, default=4096, help="GPU pool (smaller than the live histories)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-prefill-chunk", type=int, default=2048)
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--first-turn-tokens", type=int, default=1024)
    ap.add_argument("--turn-tokens", type=int, default=896)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--unique-prompts", type=int, default=64)
    ap.add_argument("--probes", type=int, default=3, help="idle turns whose history left the GPU pool")
    ap.add_argument("--probe-history-tokens", type=int, default=8192)
    ap.add_argument("--host-kv-gib", type=float, default=48.0)
    ap.add_argument("--disk-kv-dir", default="", help="default: a temporary directory")
    ap.add_argument("--disk-kv-gib", type=float, default=0.0)
    ap.add_argument("--zero-hit-host-only-kv-gib", type=float, default=0.0,
                    help="also run the 0%%-hit phase alone on an engine with only a host tier of this size (no disk), "
                         "small enough to fill: separates the host tier's cost from the disk's (0: skip)")
    ap.add_argument("--kv-load-min-speedup", type=float, default=1.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    ap.add_argument("--time-limit-s", type=float, default=540.0, help="hard limit on the whole run")
    ap.add_argument("--out", type=Path, default=Path("results/multiturn_tiers.json"))
    args = ap.parse_args()
    if args.smoke:
        args.num_blocks, args.conversations, args.turns = 16, 5, 8
        args.ttft_slo_ms, args.tpot_slo_ms = 5000.0, 500.0  # CPU-sized SLOs: goodput stays informative
        args.first_turn_tokens, args.turn_tokens, args.answer_tokens, args.unique_prompts = 24, 8, 3, 6
        args.probes, args.probe_history_tokens = 1, 48
        args.max_num_batched_tokens, args.max_prefill_chunk = 512, 256
        args.host_kv_gib = 4 * 737_280 / _GIB  # 4 blocks of the default model: most history goes to disk
        args.disk_kv_gib = 256 * 737_280 / _GIB
        args.zero_hit_host_only_kv_gib = args.host_kv_gib
        args.kv_load_min_speedup = 0.0  # always load: the smoke checks that loads happen and change nothing
    return args


def _engine_config(args: argparse.Namespace, tiers: TierConfig) -> EngineConfig:
    model = args.model
    if not model:
        from engine.loader.prepare import default_model_dir

        model = str(default_model_dir())
    return EngineConfig(model=model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                        attention_backend=args.attention_backend,
                        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
                        batcher=BatcherConfig(max_num_seqs=args.max_num_seqs,
                                              max_num_batched_tokens=args.max_num_batched_tokens,
                                              max_prefill_chunk=args.max_prefill_chunk),
                        tiers=tiers)


def _mismatched_turns(off: list[dict], on: list[dict]) -> dict[int, list[int]]:  # type: ignore[type-arg]
    """Per turn number: [turns both modes finished, of which greedy outputs differ]. Turn 1 never
    touches a tier, so its count is the engine's own batch-to-batch variation (bf16, different batch
    shapes), the baseline for the later turns."""
    by_key = {(r["conversation"], r["turn"]): r["output"] for r in off}
    counts: dict[int, list[int]] = {}
    for r in on:
        key = (r["conversation"], r["turn"])
        if key in by_key:
            both = counts.setdefault(r["turn"], [0, 0])
            both[0] += 1
            both[1] += by_key[key] != r["output"]
    return dict(sorted(counts.items()))


def _print(results: dict[str, dict]) -> None:  # type: ignore[type-arg]
    def ms(v: object) -> str:
        return "-" if v is None else f"{float(v) * 1e3:8.1f}"  # type: ignore[arg-type]

    print(f"{'mode':<10}{'TTFT p50 hit':>14}{'from tier':>11}{'TTFT p50 recompute':>20}{'goodput req/s':>15}"
          f"{'SLO %':>7}{'tok/s':>9}{'TPOT p50':>10}{'0%-hit tok/s':>14}{'0%-hit TPOT p50':>17}")
    for mode in results:
        z = results[mode]["zero_hit"]
        c = results[mode].get("conversations") or {"ttft_p50_history_hit_s": None, "ttft_p50_history_from_tier_s": None,
                                                   "ttft_p50_history_recomputed_s": None, "goodput_req_s": 0.0,
                                                   "slo_attainment": 0.0, "output_tok_s": 0.0, "tpot_p50_s": None}
        print(f"{mode:<10}{ms(c['ttft_p50_history_hit_s']):>14}{ms(c['ttft_p50_history_from_tier_s']):>11}"
              f"{ms(c['ttft_p50_history_recomputed_s']):>20}"
              f"{c['goodput_req_s']:>15.2f}{100 * c['slo_attainment']:>7.1f}{c['output_tok_s']:>9.1f}"
              f"{ms(c['tpot_p50_s']):>10}{z['output_tok_s']:>14.1f}{ms(z['tpot_p50_s']):>17}")


def main() -> int:
    args = _args()
    signal.alarm(int(args.time_limit_s) + 60)  # watchdog: a hung run dies (SIGALRM) instead of holding the GPU
    deadline = time.monotonic() + args.time_limit_s
    w = Workload(args.conversations, args.turns, args.first_turn_tokens, args.turn_tokens, args.answer_tokens,
                 args.unique_prompts, args.probes, args.probe_history_tokens)
    slo = (args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    results: dict[str, dict] = {}  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory(prefix="baton-kv-") as tmp:
        tiers = TierConfig.from_gib(args.host_kv_gib, args.disk_kv_dir or (tmp if args.disk_kv_gib else None),
                                    args.disk_kv_gib, args.kv_load_min_speedup)
        modes = [("off", TierConfig(), 0.5), ("on", tiers, 0.5)]
        if args.zero_hit_host_only_kv_gib:  # after the full modes: it only needs what they leave
            host_only = TierConfig.from_gib(args.zero_hit_host_only_kv_gib, None, 0.0, args.kv_load_min_speedup)
            modes = [("off", TierConfig(), 0.45), ("on", tiers, 0.45), ("host_only", host_only, 0.1)]
        total = deadline - time.monotonic()
        for mode, mode_tiers, share in modes:
            budget = min(total * share, deadline - time.monotonic()) - 30  # engine start-up margin
            results[mode] = asyncio.run(_run_mode(_engine_config(args, mode_tiers), w, mode, budget, slo,
                                                  zero_hit_only=mode == "host_only"))
            _release_device(args.device)
    mismatched = _mismatched_turns(results["off"].pop("_records"), results["on"].pop("_records"))
    report = {"workload": asdict(w), "args": {k: str(v) for k, v in vars(args).items()}, "modes": results,
              "mismatched_greedy_turns": mismatched}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    _print(results)
    off_p, on_p = results["off"]["probe"]["ttft_p50_s"], results["on"]["probe"]["ttft_p50_s"]
    if off_p and on_p:
        print(f"idle turn with {args.probe_history_tokens} tokens of history off the GPU: TTFT p50 recompute "
              f"{off_p * 1e3:.1f} ms, from a tier {on_p * 1e3:.1f} ms ({off_p / on_p:.1f}x)")
    for mode, r in results.items():
        z = r["engine_thread"]["zero_hit"]
        print(f"{mode}: 0%-hit phase, engine-thread time in tier hooks {z['tier_ms_per_step']:.3f} ms/step "
              f"({100 * z['tier_share_of_step_time']:.2f}% of step time, {z['steps']} steps)")
    print(f"greedy turns that differ between tiers off and on: {mismatched}; tiers: {results['on']['tiers']}")
    print(f"written to {args.out}")
    return 0


def _release_device(device: str) -> None:
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())
