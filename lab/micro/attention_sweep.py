"""The attention sweep: every candidate launch config of the paged attention kernels, per case,
beside torch SDPA and the copy / matmul ceilings, all timed in one run; then the table lines to adopt.

    timeout 560 python -m lab.micro.attention_sweep --out results/attention-sweep.json
    TRITON_INTERPRET=1 python -m lab.micro.attention_sweep --smoke --out /tmp/s.json  # CPU

- Decode (per batch x context): each `DECODE_CANDIDATES` config (engine/kernels/attention_tiles.py)
  with the split count it gives for the case, timed as a CUDA-graph replay (the engine's decode path);
  the pre-sweep baseline and the current default also eagerly (host launch included), like SDPA.
- Prefill (fresh prompts, extends): each `PREFILL_CANDIDATES` config, timed eagerly (the engine's
  prefill path); SDPA flash beside it where the batch is equal-length fresh prompts.
- Mixed (prompt chunks + decode rows): a few prefill configs, each alone (decode rows padding prefill
  tiles, as before the tables), inline (a decode tile in the prefill launch) and in the decode kernel
  (a second launch with split-KV): `MIXED_DECODE_ROWS`.
Every candidate's output is checked against a torch reference of the same values (`err`); a config
that fails to compile or exceeds MAX_REL_ERR is reported and never recommended. Each class's
recommendation is the candidate with the best geometric-mean speed-up over the baseline across the
class's cases, among those no more than 3% slower than the baseline on any of them.
Progress lines are flushed as they come and the JSON is rewritten after every case, so a time limit
leaves what was measured.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels.attention_tiles import (
    DECODE_BASELINE,
    DECODE_CANDIDATES,
    LARGE_BATCH_ROWS,
    PREFILL_BASELINE,
    PREFILL_CANDIDATES,
    WARP_SPECIALIZED_CANDIDATES,
    DecodeConfig,
    DecodeRows,
    PrefillConfig,
    PrefillRows,
    decode_config,
    decode_shape,
    prefill_config,
    prefill_shape,
)
from lab.micro.bench_attention import (
    H_KV,
    H_Q,
    HEAD_DIM,
    PagedBatch,
    Timer,
    causal_flops,
    decode_bytes,
    decode_step,
    environment,
    max_rel_err,
    measure_ceilings,
    prefill_runner,
    rotation_sets,
    sdpa_decode_fn,
    sdpa_prefill_fn,
    sm_count,
)
from lab.micro.sweep_choice import SweepRow, mark_baseline, recommend

MIXED_PREFILL_CONFIGS = (PREFILL_BASELINE[PrefillRows.LARGE], PrefillConfig(128, 64, 8, 3),
                         PrefillConfig(128, 128, 8, 3), PrefillConfig(64, 64, 4, 3))  # x 3 DecodeRows modes


@dataclass(frozen=True)
class Sweep:
    timer: Timer
    ceilings: dict
    gen: torch.Generator
    device: torch.device
    layers: int
    sms: int
    deadline: float  # time.monotonic() after which remaining candidates are skipped


def decode_cases(smoke: bool) -> list[tuple[int, int]]:
    if smoke:
        return [(2, 40)]
    return [(1, 8192), (8, 8192), (32, 2048), (64, 4096), (128, 1024), (4, 1024), (16, 8192)]


@dataclass(frozen=True)
class PrefillCase:
    name: str
    seq_lens: list[int]
    query_lens: list[int]  # a 1 marks a decode row: the case is a mixed step

    @property
    def mixed(self) -> bool:
        return 1 in self.query_lens

    @property
    def rows(self) -> int:
        return sum(self.query_lens) * (H_Q // H_KV)


def prefill_cases(smoke: bool) -> list[PrefillCase]:
    if smoke:
        return [PrefillCase("2x24", [24, 24], [24, 24]),
                PrefillCase("mixed 1x24 + 3 decodes", [24, 30, 17, 9], [24, 1, 1, 1])]
    return [PrefillCase("1x8192", [8192], [8192]), PrefillCase("4x2048", [2048] * 4, [2048] * 4),
            PrefillCase("mixed 2x1024 + 64 decodes", [3072] * 2 + [2048] * 64, [1024] * 2 + [1] * 64),
            PrefillCase("extend 4x512 on 4k", [4608] * 4, [512] * 4),
            PrefillCase("extend 1x256 on 2k", [2304], [256])]


def _reference_itself() -> None:
    """The check of an SDPA row: it is (a copy of) the reference."""


def measured(sweep: Sweep, row: SweepRow, check: Callable[[], float | None], time_it: Callable[[], None]) -> SweepRow:
    """Fill `row` by checking then timing; a config that fails (e.g. too much shared memory on this
    card) or runs out of time is a row with `error`, not a crash of the sweep."""
    if time.monotonic() > sweep.deadline:
        row.error = "skipped: --budget-s spent"
        return row
    try:
        row.err = check()
        time_it()
    except Exception as exc:  # noqa: BLE001 - any failure of one candidate is that candidate's result
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return row


def sweep_decode(sweep: Sweep, batch: int, ctx: int, candidates: tuple[DecodeConfig, ...]) -> list[SweepRow]:
    kv_bytes = decode_bytes(batch, ctx)
    paged = PagedBatch([ctx] * batch, sweep.layers, rotation_sets(kv_bytes), sweep.device, sweep.gen)
    query = torch.randn(batch, H_Q, HEAD_DIM, generator=sweep.gen, device=sweep.device, dtype=torch.bfloat16)
    size, length = decode_shape(batch, H_KV, sweep.sms, ctx)
    case, shape = f"B={batch} ctx={ctx}", f"(DecodeBatch.{size.name}, ContextLength.{length.name})"
    sdpa = sdpa_decode_fn(paged, query)
    ref = sdpa().squeeze(2)
    sdpa_row = SweepRow("decode", case, shape, "sdpa", "")
    rows = [measured(sweep, sdpa_row, _reference_itself, partial(_time_decode, sweep, sdpa_row, sdpa, True))]
    default = decode_config(batch, H_KV, sweep.sms, ctx)
    for config in dict.fromkeys((*candidates, default)):
        splits = config.num_splits(batch, H_KV, sweep.sms, ctx)
        step = decode_step(paged, query, config, splits)
        row = SweepRow("decode", case, shape, config.label() + (" (default)" if config == default else ""),
                       repr(config), num_splits=splits)

        eager = config in (DECODE_BASELINE, default)
        timing = partial(_time_decode, sweep, row, step, eager)
        rows.append(measured(sweep, row, partial(_decode_err, step, ref), timing))
    for row in rows:
        if row.ms:
            row.rate = kv_bytes / row.ms / 1e6
            row.of_ceiling = row.rate / sweep.ceilings["copy_gb_s"] if sweep.ceilings["copy_gb_s"] else None
            row.vs_sdpa = sdpa_row.ms / row.ms if sdpa_row.ms else None
    mark_baseline(rows, repr(DECODE_BASELINE))
    return rows


def _decode_err(step: Callable[..., torch.Tensor], ref: torch.Tensor) -> float:
    return max_rel_err(step(0), ref)


def _time_decode(sweep: Sweep, row: SweepRow, step: Callable[..., torch.Tensor], eager: bool) -> None:
    row.ms = sweep.timer.graph(step)
    if eager:
        row.eager_ms = sweep.timer(step)


def prefill_reference(paged: PagedBatch, query: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
    """fp32 attention of every query row (at the end of its sequence's context) over the same values."""
    group, outs, row = H_Q // H_KV, [], 0
    for i, (seq_len, q_len) in enumerate(zip(paged.seq_lens, query_lens, strict=True)):
        keys = paged.contiguous_kv(0, i).float().repeat_interleave(group, dim=0)  # [H_q, S, D]
        values = paged.contiguous_kv(1, i).float().repeat_interleave(group, dim=0)
        q = query[row:row + q_len].float().transpose(0, 1)  # [H_q, q_len, D]
        pos = torch.arange(seq_len, device=query.device)
        visible = pos[None, :] <= pos[seq_len - q_len:, None]  # [q_len, S]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=HEAD_DIM**-0.5)
        outs.append(out.transpose(0, 1))
        row += q_len
    return torch.cat(outs)


def _prefill_err(run: Callable[[], torch.Tensor], ref: torch.Tensor, query_lens: list[int]) -> float:
    return per_sequence_err(run(), ref, query_lens)


def _time_prefill(sweep: Sweep, row: SweepRow, run: Callable[[], torch.Tensor]) -> None:
    row.ms = sweep.timer(run)


def per_sequence_err(out: torch.Tensor, ref: torch.Tensor, query_lens: list[int]) -> float:
    bounds = torch.tensor([0, *query_lens]).cumsum(0).tolist()
    pairs = zip(bounds, bounds[1:], strict=False)
    return max(max_rel_err(out[a:b].unsqueeze(0), ref[a:b].unsqueeze(0)) for a, b in pairs)


def sweep_prefill(sweep: Sweep, case: PrefillCase, candidates: tuple[PrefillConfig, ...],
                  with_sdpa: bool = True) -> list[SweepRow]:
    name, seq_lens, query_lens, mixed = case.name, case.seq_lens, case.query_lens, case.mixed
    paged = PagedBatch(seq_lens, sweep.layers, 1, sweep.device, sweep.gen)
    query = torch.randn(sum(query_lens), H_Q, HEAD_DIM, generator=sweep.gen, device=sweep.device,
                        dtype=torch.bfloat16)
    ref = prefill_reference(paged, query, query_lens)
    kind, group = "mixed" if mixed else "prefill", H_Q // H_KV
    rows_class = prefill_shape(len(query), group)
    shape = f"PrefillRows.{rows_class.name}"
    rows = []
    if with_sdpa and seq_lens == query_lens and len(set(seq_lens)) == 1:
        sdpa_row = SweepRow(kind, name, shape, "sdpa", "")
        timing = partial(_time_prefill, sweep, sdpa_row, sdpa_prefill_fn(paged, query))
        rows.append(measured(sweep, sdpa_row, _reference_itself, timing))
    default = prefill_config(len(query), group)
    configs = dict.fromkeys((*candidates, default))
    modes = tuple(DecodeRows) if mixed else (DecodeRows.INLINE,)  # INLINE: no decode rows, no difference
    for config, mode in [(c, m) for c in configs for m in modes]:
        run = prefill_runner(paged, query, query_lens, config, mode)
        label = config.label() + (f" {mode.value}" if mixed else "") + (" (default)" if config == default else "")
        row = SweepRow(kind, name, shape, label, repr(config), decode_rows=f"DecodeRows.{mode.name}" if mixed else None)
        check = partial(_prefill_err, run, ref, query_lens)
        rows.append(measured(sweep, row, check, partial(_time_prefill, sweep, row, run)))
    flops = causal_flops(seq_lens, query_lens)
    sdpa_ms = rows[0].ms if rows and rows[0].variant == "sdpa" else None
    for row in rows:
        if row.ms:
            row.rate = flops / row.ms / 1e9
            row.of_ceiling = row.rate / sweep.ceilings["matmul_tflop_s"] if sweep.ceilings["matmul_tflop_s"] else None
            row.vs_sdpa = sdpa_ms / row.ms if sdpa_ms else None
    mark_baseline(rows, repr(PREFILL_BASELINE[rows_class]))
    return rows


def print_rows(rows: list[SweepRow]) -> None:
    print(f"{'kind':8}{'case':27}{'variant':44}{'splits':>7}{'ms':>9}{'eager':>9}{'rate':>8}{'ceil%':>7}"
          f"{'xSDPA':>7}{'xBase':>7}{'err':>9}")
    for r in rows:
        if r.error:
            print(f"{r.kind:8}{r.case[:26]:27}{r.variant[:43]:44}  {r.error}")
            continue
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{r.kind:8}{r.case[:26]:27}{r.variant[:43]:44}{fmt(r.num_splits, 'd'):>7}{fmt(r.ms, '.4f'):>9}"
              f"{fmt(r.eager_ms, '.4f'):>9}{fmt(r.rate, '.0f'):>8}{fmt(r.of_ceiling and 100 * r.of_ceiling, '.0f'):>7}"
              f"{fmt(r.vs_sdpa, '.2f'):>7}{fmt(r.vs_baseline, '.2f'):>7}{fmt(r.err, '.1e'):>9}")


def sweep_jobs(sweep: Sweep, smoke: bool) -> list[Callable[[], list[SweepRow]]]:
    """One job per case, most wanted first; warp-specialized configs last (they may abort the compiler)."""
    few = 1 if smoke else None  # the interpreter takes seconds per launch: a smoke run checks one of each
    decode, prefill, mixed = DECODE_CANDIDATES[:few], PREFILL_CANDIDATES[:few], MIXED_PREFILL_CONFIGS[:few]
    baseline_large = (PREFILL_BASELINE[PrefillRows.LARGE],)
    jobs: list[Callable[[], list[SweepRow]]] = [partial(sweep_decode, sweep, b, c, decode)
                                                for b, c in decode_cases(smoke)]
    jobs += [partial(sweep_prefill, sweep, case, mixed if case.mixed else prefill) for case in prefill_cases(smoke)]
    if not smoke:
        jobs += [partial(sweep_prefill, sweep, case, baseline_large + WARP_SPECIALIZED_CANDIDATES, with_sdpa=False)
                 for case in prefill_cases(smoke) if not case.mixed and case.rows >= LARGE_BATCH_ROWS]
    return jobs


def run_sweep(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    timer = Timer(device.type == "cuda")
    ceilings = measure_ceilings(timer, device)
    sweep = Sweep(timer, ceilings, torch.Generator(device=device).manual_seed(0), device, args.layers,
                  sm_count(device), time.monotonic() + args.budget_s)
    result = {**environment(device, args.layers), "ceilings": ceilings, "rows": []}
    print(f"{result['device']} copy {ceilings['copy_gb_s'] or 0:.0f} GB/s, matmul "
          f"{ceilings['matmul_tflop_s'] or 0:.0f} TFLOP/s, {sweep.sms} SMs", flush=True)
    rows: list[SweepRow] = []
    jobs = sweep_jobs(sweep, args.smoke)
    for job in jobs:
        case_rows = job()
        print_rows(case_rows)
        rows += case_rows
        result["rows"] = [asdict(r) for r in rows]
        result["recommended"] = recommend(rows)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n== all rows ==")
    print_rows(rows)
    print("\n== table lines to adopt (engine/kernels/attention_tiles.py) ==")
    print("\n".join(result["recommended"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path (rewritten after every case)")
    parser.add_argument("--layers", type=int, default=2, help="layers in the block-major cache")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU (run with TRITON_INTERPRET=1): checks the script, not speed")
    parser.add_argument("--budget-s", type=float, default=480,
                        help="seconds after which the remaining candidates are skipped (still reported)")
    run_sweep(parser.parse_args())


if __name__ == "__main__":
    main()
