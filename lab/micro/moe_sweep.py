"""`bench_moe --sweep`: the fused MoE kernel's launch configurations, timed one by one.

For each case (1, 64 and 4096 tokens at Qwen3-30B-A3B's MoE shape: the decode batches and the
prefill of bench_moe) and each candidate of its rows class (engine/kernels/fused_moe_configs.py,
`sweep_candidates`, <= 12):
- the output against the torch reference (`rel_err`, ||fused - ref|| / ||ref||; a candidate over
  1e-2 is never chosen), then the expert alignment, the gate_up GEMM (SiLU fused) and the down
  GEMM, each captured in its own CUDA graph and timed by replay (CUDA events, L2 flushed between
  runs: a decode step's weights come from HBM too). Graph replay is what decode sees; eager timing
  of a ~10 us kernel measures triton's Python launch instead.
- The winner: the block_m whose best gate_up tile + best down tile + alignment is least, with those
  two tiles; then the whole expert layer with it (`case` = moe_layer, config = its table line), and
  the code as it was before this table (torch alignment, 64 x 64 tiles, 4 warps, a separate SiLU
  kernel: config = "before") for comparison, both with the weighted combine; then an `align` row:
  the one-program alignment kernel (align_us) against the torch one (layer_us), which says where
  FUSED_ALIGN_MAX_SLOTS belongs. of_floor = the routed experts' bytes / copy bandwidth / time;
  of_matmul = active FLOPs / time / the matmul rate (both ceilings measured in the same run).
The winners print as `CONFIGS` lines (paste into fused_moe_configs.py), and bench_moe runs the whole
model's decode and prefill rows with them. `--smoke` runs the same code on CPU under
TRITON_INTERPRET=1 at a tiny shape (the times are then meaningless).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.kernels.fused_moe_configs import (
    GemmTile,
    MoeKernelConfig,
    RowsPerExpert,
    rows_per_expert_class,
    sweep_candidates,
    table_entry,
)
from engine.layers.moe_ops import combine_expert_outputs, expert_outputs_reference, route_tokens

MAX_REL_ERR = 1e-2
BEFORE = MoeKernelConfig(0, GemmTile(64, 64, 4, 3), GemmTile(64, 64, 4, 3))  # block_m by the old rule


@dataclass(frozen=True)
class MoeShape:
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int

    @staticmethod
    def of(config: ModelConfig) -> MoeShape:
        assert config.moe is not None, "a dense model has no MoE layer to sweep"
        moe = config.moe
        return MoeShape(config.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k)

    @property
    def expert_bytes(self) -> int:  # bf16
        return 3 * self.hidden * self.intermediate * 2


@dataclass(frozen=True)
class CaseInputs:
    x: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor  # routing weights [T, k]
    w13: torch.Tensor
    w2: torch.Tensor
    reference: torch.Tensor  # the torch expert loop's [T, k, H]


def case_inputs(shape: MoeShape, tokens: int, device: str, dtype: torch.dtype) -> CaseInputs:
    gen = torch.Generator(device=device).manual_seed(tokens)
    w13 = (torch.randn(shape.num_experts, 2 * shape.intermediate, shape.hidden, device=device, generator=gen)
           * 0.02).to(dtype)
    w2 = (torch.randn(shape.num_experts, shape.hidden, shape.intermediate, device=device, generator=gen)
          * 0.02).to(dtype)
    x = torch.randn(tokens, shape.hidden, device=device, generator=gen).to(dtype)
    routing = route_tokens(torch.randn(tokens, shape.num_experts, device=device, generator=gen), shape.top_k, True)
    reference = expert_outputs_reference(x, routing.expert_ids, w13, w2)
    return CaseInputs(x, routing.expert_ids, routing.weights, w13, w2, reference)


def timed_us(fn: Callable[[], object]) -> float:
    """Replay time of `fn` captured in a CUDA graph (µs); on CPU (interpreter) one call's wall time."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton

    for _ in range(2):  # compile and warm outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * float(triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median"))


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((ours.double() - ref.double()).norm() / ref.double().norm()).item())


def candidate_row(inputs: CaseInputs, shape: MoeShape, config: MoeKernelConfig) -> dict:
    from engine.kernels.fused_moe import align_slots_to_experts, fused_expert_outputs, grouped_gemm

    row: dict = {"config": str(config), "block_m": config.block_m}
    try:
        row["rel_err"] = rel_err(fused_expert_outputs(inputs.x, inputs.expert_ids, inputs.w13, inputs.w2, config),
                                 inputs.reference)
        align = align_slots_to_experts(inputs.expert_ids, shape.num_experts, config.block_m)
        act = grouped_gemm(inputs.x, inputs.w13, align, shape.top_k, config.gate_up, fuse_silu=True)
        row["align_us"] = timed_us(lambda: align_slots_to_experts(inputs.expert_ids, shape.num_experts,
                                                                  config.block_m))
        row["up_us"] = timed_us(lambda: grouped_gemm(inputs.x, inputs.w13, align, shape.top_k, config.gate_up,
                                                     fuse_silu=True))
        row["down_us"] = timed_us(lambda: grouped_gemm(act, inputs.w2, align, 1, config.down))
    except Exception as e:  # a tile that does not fit (shared memory, registers) is a result, not a crash
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return row


def best_config(rows: list[dict], candidates: list[MoeKernelConfig]) -> MoeKernelConfig:
    """Per block_m: the fastest correct gate_up tile and down tile; then the block_m least in total."""
    by_block_m: dict[int, tuple[float, MoeKernelConfig]] = {}
    for block_m in {c.block_m for c in candidates}:
        ok = [(r, c) for r, c in zip(rows, candidates, strict=True)
              if c.block_m == block_m and "error" not in r and r["rel_err"] <= MAX_REL_ERR]
        if not ok:
            continue
        up_row, up = min(ok, key=lambda rc: rc[0]["up_us"])
        down_row, down = min(ok, key=lambda rc: rc[0]["down_us"])
        total = up_row["align_us"] + up_row["up_us"] + down_row["down_us"]
        by_block_m[block_m] = (total, MoeKernelConfig(block_m, up.gate_up, down.down))
    if not by_block_m:
        raise RuntimeError("no candidate configuration was correct")
    return min(by_block_m.values(), key=lambda tc: tc[0])[1]


def layer_us(inputs: CaseInputs, config: MoeKernelConfig | None) -> float:
    """The whole expert layer (alignment, both GEMMs, the weighted combine); None: the code before."""
    from engine.kernels.fused_moe import fused_expert_outputs

    if config is None:
        return timed_us(lambda: combine_expert_outputs(before_expert_outputs(inputs), inputs.weights))
    return timed_us(lambda: combine_expert_outputs(
        fused_expert_outputs(inputs.x, inputs.expert_ids, inputs.w13, inputs.w2, config), inputs.weights))


def align_row(inputs: CaseInputs, shape: MoeShape, block_m: int) -> dict:
    """Both alignment implementations on this case (align_us: the one-program kernel; before: torch
    ops): says where `FUSED_ALIGN_MAX_SLOTS` should sit."""
    from engine.kernels.moe_align import align_slots_to_experts_fused, align_slots_to_experts_torch

    ids, experts = inputs.expert_ids, shape.num_experts
    return {"case": "align", "tokens": ids.shape[0], "config": f"fused vs torch, m{block_m}",
            "align_us": timed_us(lambda: align_slots_to_experts_fused(ids, experts, block_m)),
            "layer_us": timed_us(lambda: align_slots_to_experts_torch(ids, experts, block_m))}


def before_expert_outputs(inputs: CaseInputs) -> torch.Tensor:
    """The expert compute as it was before the table: torch alignment, 64 x 64 tiles, SiLU separate."""
    from engine.kernels.fused_moe import grouped_gemm
    from engine.kernels.moe_align import align_slots_to_experts_torch
    from engine.kernels.silu_mul import silu_and_mul

    tokens, top_k = inputs.expert_ids.shape
    per_expert = tokens * top_k / inputs.w13.shape[0]
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    align = align_slots_to_experts_torch(inputs.expert_ids, inputs.w13.shape[0], block_m)
    gate_up = grouped_gemm(inputs.x, inputs.w13, align, top_k, BEFORE.gate_up)
    return grouped_gemm(silu_and_mul(gate_up), inputs.w2, align, 1, BEFORE.down).view(tokens, top_k, -1)


def layer_row(inputs: CaseInputs, shape: MoeShape, config: MoeKernelConfig | None, ceilings: dict) -> dict:
    tokens = inputs.x.shape[0]
    us = layer_us(inputs, config)
    routed = int(inputs.expert_ids.unique().numel())
    flops = 2.0 * tokens * shape.top_k * shape.expert_bytes / 2
    row: dict = {"case": "moe_layer", "tokens": tokens, "config": "before" if config is None else str(config),
                 "layer_us": us, "experts_routed": routed}
    copy_gb_s, matmul_tflop_s = ceilings.get("copy_gb_s"), ceilings.get("matmul_tflop_s")
    if copy_gb_s and matmul_tflop_s:
        floor_us = routed * shape.expert_bytes / copy_gb_s / 1e3
        row.update(floor_us=floor_us, of_floor=floor_us / us, tflop_s=flops / us / 1e6,
                   of_matmul=flops / us / 1e6 / matmul_tflop_s)
    return row


def sweep(shape: MoeShape, token_cases: list[int], ceilings: dict, device: str, dtype: torch.dtype,
          max_candidates: int = 12) -> tuple[list[dict], dict[tuple[RowsPerExpert, int, int], MoeKernelConfig]]:
    """Every case's candidate rows, then its winner's and the old code's whole-layer rows; the winners
    keyed as `CONFIGS` is (one per rows class: the first case of a class decides)."""
    rows: list[dict] = []
    winners: dict[tuple[RowsPerExpert, int, int], MoeKernelConfig] = {}
    for tokens in token_cases:
        rows_class = rows_per_expert_class(tokens * shape.top_k, shape.num_experts)
        inputs = case_inputs(shape, tokens, device, dtype)
        candidates = sweep_candidates(rows_class)[:max_candidates]
        case_rows = [{"case": "candidate", "tokens": tokens, **candidate_row(inputs, shape, c)} for c in candidates]
        for row in case_rows:
            print("row", row, flush=True)
        best = best_config(case_rows, candidates)
        key = (rows_class, shape.hidden, shape.intermediate)
        winners.setdefault(key, best)
        rows += case_rows
        rows += [layer_row(inputs, shape, best, ceilings), layer_row(inputs, shape, None, ceilings),
                 align_row(inputs, shape, best.block_m)]
        rows[-3]["table_line"] = table_entry(*key, best).strip()
        print("row", rows[-3], "\nrow", rows[-2], "\nrow", rows[-1], flush=True)
        del inputs
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, winners


def require_compiled_or_interpreted(device: str) -> None:
    """On CPU the kernels run only under triton's interpreter, which must be on before triton loads."""
    from engine.kernels.fused_moe import _grouped_gemm_kernel
    from engine.kernels.kv_store import is_interpreted

    if device == "cpu" and not is_interpreted(_grouped_gemm_kernel):
        raise SystemExit("--sweep --smoke runs the kernels on CPU: set TRITON_INTERPRET=1 in the environment")


SWEEP_COLUMNS = ["case", "tokens", "config", "rel_err", "align_us", "up_us", "down_us", "layer_us", "floor_us",
                 "of_floor", "of_matmul", "error"]


def print_sweep(rows: list[dict], winner_lines: list[str]) -> None:
    print("\n" + "  ".join(f"{c:>10}" for c in SWEEP_COLUMNS))
    for row in rows:
        print("  ".join(f"{_cell(row.get(c)):>10}" for c in SWEEP_COLUMNS))
    print("\nwinners, as lines of CONFIGS in engine/kernels/fused_moe_configs.py:")
    for line in winner_lines:
        print(line)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return "-" if value is None else str(value)
