"""The KV hand-off plan of a pipeline-parallel prefill worker (kvtransfer/stages.py).

- The routes between whole workers: the same split rank to rank, merges into fewer decode stages, and
  the refusal of a stage whose layers would span two decode stages.
- The slices: each prefill rank's layers, its decode peer rank and byte range inside a decode block.
- The decode side's descriptor rows of a slice.
- Identity: a PP=2 prefill (this process is rank 0 of a real 2-process gloo worker) hands its KV to a
  PP=1 decode runner, each stage's blocks moved from that stage's own KV cache by the slices'
  descriptor rows (byte addresses into the decode tensor, as NIXL would write them), into other block
  ids; the decode runner's greedy tokens equal a co-located runner's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.batch import BatchPlan, ScheduledChunk
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from engine.kv_cache import KVCacheSpec
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.parallel.launcher import TensorParallelRunner, create_model_runner
from engine.parallel.pipeline import stage_layers
from engine.sampling_params import SamplingParams
from kvtransfer.base import HandshakeInfo
from kvtransfer.errors import InvalidTransferPlanError
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.nixl.descriptors import layer_slice_rows
from kvtransfer.stages import ChecksumGroup, LayerSlice, checksum_groups, stage_layout_problem, stage_routes

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=96,
                     num_layers=3, num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
PROMPTS = ((5, 17, 3, 88, 42, 7, 19, 60, 2), (33, 1, 90, 45, 12))
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
NEW_TOKENS = 8
PREFILL_BLOCKS = ((3, 4, 5, 6, 7), (10, 11, 12, 13, 14))  # 5 blocks of 4 hold prompt + 8 tokens
DECODE_BLOCKS = ((30, 21, 22, 9, 1), (2, 25, 26, 27, 0))  # elsewhere, not in order


def _info(layout: KVLayoutInfo, base_address: int, num_blocks: int) -> HandshakeInfo:
    return HandshakeInfo(layout, "agent", b"x", base_address, num_blocks, layout.bytes_per_block, "cpu", device_id=1)


def test_a_layer_slices_rows_are_its_byte_range_of_every_block() -> None:
    whole = _ranks(3, 1)[0]
    per_layer = whole.bytes_per_block // 3
    assert per_layer == 2 * 4 * 2 * 8 * 4
    rows = layer_slice_rows(_info(whole, 1 << 20, 8), np.array([5, 0, 7]), first_layer=2, num_layers=1)
    assert rows.tolist() == [[(1 << 20) + b * whole.bytes_per_block + 2 * per_layer, per_layer, 1] for b in (5, 0, 7)]
    with pytest.raises(InvalidTransferPlanError, match="outside the 3 layers"):
        layer_slice_rows(_info(whole, 1 << 20, 8), np.array([0]), first_layer=2, num_layers=2)


# ------------------------------------------------------------------------- identity through a real PP=2 prefill


class StageKVExport:
    """Rank service (picklable factory): hands rank 0 the follower stage's KV blocks, as the follower's
    own NIXL agent would read them."""

    def __call__(self, runner: ModelRunner, tp: Any) -> StageKVExport:
        self.kv_cache = runner.kv_cache
        return self

    def handle(self, request: object) -> object:
        assert isinstance(request, StageBlocks), request
        return self.kv_cache[list(request.block_ids)].clone()

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class StageBlocks:
    """Reply: the follower stage's KV blocks."""

    block_ids: tuple[int, ...]


def _chunk(rid: int, tokens: list[int], start: int, blocks: tuple[int, ...]) -> ScheduledChunk:
    return ScheduledChunk(str(rid), tuple(tokens[start:]), start, blocks, True, GREEDY, PROMPTS[rid], [])


def _prefill(runner: ModelRunner | TensorParallelRunner, blocks: tuple[tuple[int, ...], ...]) -> list[int]:
    """Both prompts in one step (two micro-batches under PP); their first tokens."""
    plan = BatchPlan(tuple(_chunk(i, list(p), 0, blocks[i]) for i, p in enumerate(PROMPTS)))
    sampled = runner.execute(plan).sampled
    return [sampled[str(i)].token_id for i in range(len(PROMPTS))]


def _decode(runner: ModelRunner, firsts: list[int], blocks: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    seqs = [[*p, t] for p, t in zip(PROMPTS, firsts, strict=True)]
    while len(seqs[0]) < len(PROMPTS[0]) + NEW_TOKENS:
        plan = BatchPlan(tuple(_chunk(i, s, len(s) - 1, blocks[i]) for i, s in enumerate(seqs)))
        sampled = runner.execute(plan).sampled
        for i, s in enumerate(seqs):
            s.append(sampled[str(i)].token_id)
    return [s[len(p):] for s, p in zip(seqs, PROMPTS, strict=True)]


def _hand_off(stage_blocks: list[torch.Tensor], decode_kv: torch.Tensor) -> None:
    """Write each stage's blocks where its route's descriptor rows point (byte addresses from 1)."""
    flat = decode_kv.view(-1).view(torch.uint8)
    decode = _info(_ranks(3, 1)[0], 1, decode_kv.shape[0])
    local = [b for seq in PREFILL_BLOCKS for b in seq]
    remote = np.array([b for seq in DECODE_BLOCKS for b in seq])
    for blocks, route in zip(stage_blocks, stage_routes(_ranks(3, 2), [decode.layout]), strict=True):
        assert route.layers is not None
        rows = layer_slice_rows(decode, remote, route.layers.dst_first, route.layers.num_layers)
        src = blocks.contiguous().view(len(local), -1).view(torch.uint8)
        for i, (address, length, _) in enumerate(rows.tolist()):
            flat[address - 1:address - 1 + length] = src[i]


@pytest.mark.timeout(120)
def test_pp2_prefill_handed_to_a_pp1_decode_gives_the_colocated_tokens(tmp_path: Path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=[CONFIG.architecture], vocab_size=CONFIG.vocab_size, hidden_size=CONFIG.hidden_size,
        intermediate_size=CONFIG.intermediate_size, num_hidden_layers=CONFIG.num_layers,
        num_attention_heads=CONFIG.num_heads, num_key_value_heads=CONFIG.num_kv_heads, head_dim=CONFIG.head_dim,
        max_position_embeddings=CONFIG.max_position_embeddings)))
    base = EngineConfig(model=str(tmp_path), load_format="dummy", seed=3,
                        cache=CacheConfig(block_size=4, num_blocks=32))

    def runner(parallel: ParallelConfig | None = None) -> ModelRunner | TensorParallelRunner:
        loaded = load_model(base.model, "dummy", "float32", "cpu", seed=base.seed)
        config = base if parallel is None else dataclasses.replace(base, parallel=parallel)
        return create_model_runner(config, loaded.model_config, loaded.weights, StageKVExport())

    colocated = runner()
    expected = _decode(colocated, _prefill(colocated, DECODE_BLOCKS), DECODE_BLOCKS)

    prefill = runner(ParallelConfig(pipeline_parallel_size=2, timeout_s=60))
    assert isinstance(prefill, TensorParallelRunner)
    try:
        firsts = _prefill(prefill, PREFILL_BLOCKS)
        ids = tuple(b for seq in PREFILL_BLOCKS for b in seq)
        stage_blocks = [prefill.kv_cache[list(ids)].clone(), *prefill.call_followers(StageBlocks(ids))]
    finally:
        prefill.shutdown()
    assert [b.shape[1] for b in stage_blocks] == [2, 1]  # layers 0-1 on stage 0, layer 2 on stage 1

    decode = runner()
    assert isinstance(decode, ModelRunner)
    _hand_off(stage_blocks, decode.kv_cache)
    assert _decode(decode, firsts, DECODE_BLOCKS) == expected


# ------------------------------------------------------------------------- routes between whole workers


def _ranks(num_layers: int, pp: int, tp: int = 1) -> list[KVLayoutInfo]:
    """Every rank's layout of a worker of `pp` stages x `tp` tensor ranks, in world-rank order."""
    out = []
    for stage in range(pp):
        layers = stage_layers(num_layers, pp, stage)
        spec = dataclasses.replace(SPEC, num_layers=len(layers))
        out += [KVLayoutInfo.from_spec(spec, "m", tp_size=tp, tp_rank=r, pp_size=pp, pp_rank=stage,
                                       first_layer=layers.start) for r in range(tp)]
    return out


def test_the_same_split_goes_rank_to_rank_with_whole_blocks() -> None:
    routes = stage_routes(_ranks(30, 2, tp=2), _ranks(30, 2, tp=2))
    assert [(r.src_rank, r.dst_rank, r.layers) for r in routes] == [(0, 0, None), (1, 1, None), (2, 2, None),
                                                                     (3, 3, None)]


def test_stages_merge_into_the_decode_stage_holding_their_layers() -> None:
    to_one = stage_routes(_ranks(30, 2, tp=2), _ranks(30, 1, tp=2))
    assert [(r.src_rank, r.dst_rank, r.layers) for r in to_one] == [
        (0, 0, LayerSlice(0, 0, 15)), (1, 1, LayerSlice(0, 0, 15)),
        (2, 0, LayerSlice(0, 15, 15)), (3, 1, LayerSlice(0, 15, 15))]
    four_to_two = stage_routes(_ranks(32, 4), _ranks(32, 2))
    assert [(r.dst_rank, r.layers) for r in four_to_two] == [
        (0, LayerSlice(0, 0, 8)), (0, LayerSlice(0, 8, 8)), (1, LayerSlice(0, 0, 8)), (1, LayerSlice(0, 8, 8))]


def test_checksum_groups_place_each_senders_checksums_where_its_kv_lands() -> None:
    # the same split (and heterogeneous TP): one group per receiving rank, whole blocks
    assert checksum_groups(_ranks(30, 2, tp=2), _ranks(30, 2, tp=2)) == tuple(ChecksumGroup(r) for r in range(4))
    one_rank = [dataclasses.replace(_ranks(30, 1)[0], num_kv_heads=4)]
    heads = [dataclasses.replace(r, num_kv_heads=2) for r in _ranks(30, 1, tp=2)]
    assert checksum_groups(one_rank, heads) == (ChecksumGroup(0), ChecksumGroup(1))
    # stages merged into fewer: one group per prefill rank, at its layers in the decode rank of its tensor rank
    assert checksum_groups(_ranks(30, 2, tp=2), _ranks(30, 1, tp=2)) == (
        ChecksumGroup(0, LayerSlice(0, 0, 15)), ChecksumGroup(1, LayerSlice(0, 0, 15)),
        ChecksumGroup(0, LayerSlice(0, 15, 15)), ChecksumGroup(1, LayerSlice(0, 15, 15)))
    with pytest.raises(ValueError, match="stage 1's layers 8-15 lie in no one stage"):
        checksum_groups(_ranks(30, 4), _ranks(30, 2))


def test_a_stage_whose_layers_span_two_decode_stages_has_no_route() -> None:
    # 30 layers: PP4 holds 0-7 | 8-15 | 16-22 | 23-29, PP2 holds 0-14 | 15-29: stage 1 spans both.
    assert stage_layout_problem(_ranks(30, 4), _ranks(30, 2)) == [
        ("pp_size", 4, 2), ("layer ranges", "PP4: layers 0-7 | 8-15 | 16-22 | 23-29", "PP2: layers 0-14 | 15-29"),
        ("route", "stage 1's layers 8-15 lie in no one stage of the other side (splitting a stage's layers over "
                  "several stages is not built)", "")]
    assert stage_layout_problem(_ranks(30, 1), _ranks(30, 2))[1][0] == "layer ranges"
    assert stage_layout_problem(_ranks(32, 4), _ranks(32, 2)) == []


def test_another_model_depth_is_named() -> None:
    assert stage_layout_problem(_ranks(30, 2), _ranks(32, 1)) == [("pp_size", 2, 1), ("model layers", 30, 32)]
