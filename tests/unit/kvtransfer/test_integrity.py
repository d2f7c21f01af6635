"""Per-block checksums and fault injection switches (no NIXL needed)."""

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from engine.kv_integrity import layer_slice_checksums
from kvtransfer.faults import Fault, FaultConfig, FaultInjector, corrupt_block_byte
from kvtransfer.integrity import block_checksums, mismatched_blocks

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def _kv(num_blocks: int = 40, dtype: str = "bfloat16") -> torch.Tensor:
    torch.manual_seed(0)
    spec = KVCacheSpec(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, SPEC.block_size, dtype)
    return torch.randn((num_blocks, *spec.block_shape)).to(spec.torch_dtype)


def test_equal_blocks_have_equal_checksums() -> None:
    kv = _kv()
    kv[7] = kv[3]
    a, b = block_checksums(kv, [3, 7])
    assert a == b


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_any_flipped_byte_is_detected(dtype: str) -> None:
    kv = _kv(dtype=dtype)
    before = block_checksums(kv, [5])
    nbytes = SPEC.bytes_per_block * (2 if dtype == "float32" else 1)
    for offset in (0, 1, nbytes // 2, nbytes - 1):
        corrupted = kv.clone()
        corrupt_block_byte(corrupted, 5, offset)
        assert block_checksums(corrupted, [5]) != before, offset


def test_swapped_words_are_detected() -> None:
    kv = _kv()
    words = kv[2].reshape(-1).view(torch.int16)
    before = block_checksums(kv, [2])
    words[[0, 1]] = words[[1, 0]].clone()
    assert block_checksums(kv, [2]) != before


def test_checksums_follow_block_id_order_across_chunks() -> None:
    kv = _kv()
    ids = list(range(39, -1, -1))  # 40 ids: more than one 32-block chunk
    assert block_checksums(kv, ids) == [block_checksums(kv, [i])[0] for i in ids]


def test_mismatched_blocks_names_the_corrupted_block() -> None:
    kv = _kv()
    ids = [9, 4, 31]
    expected = block_checksums(kv, ids)
    corrupt_block_byte(kv, 4)
    assert mismatched_blocks(kv, ids, expected) == [4]


def test_a_layer_slices_checksums_are_those_of_a_stage_holding_just_those_layers() -> None:
    whole = torch.randn((8, 5, 2, 4, 2, 8)).to(torch.bfloat16)  # 5 layers per block
    ids = [6, 1, 3]
    stage = whole[:, 2:4].contiguous()  # a stage of layers 2-3: its own KV cache, [blocks, 2 layers, ...]
    assert layer_slice_checksums(whole, ids, 2, 2) == block_checksums(stage, ids)
    assert layer_slice_checksums(whole, ids, 0, 5) == block_checksums(whole, ids)
    with pytest.raises(ValueError, match="outside the 5 layers"):
        layer_slice_checksums(whole, ids, 4, 2)


def test_armed_fault_fires_once() -> None:
    faults = FaultInjector()
    faults.arm(Fault.FAIL_TRANSFER)
    fired = [faults.should_inject(Fault.FAIL_TRANSFER) for _ in range(3)]
    assert fired == [True, False, False]
    assert faults.injected(Fault.FAIL_TRANSFER) == 1


def test_fault_rates_are_deterministic_for_a_seed() -> None:
    def draws() -> list[bool]:
        faults = FaultInjector(FaultConfig(stall_transfer_rate=0.5, seed=7))
        return [faults.should_inject(Fault.STALL_TRANSFER) for _ in range(32)]

    first = draws()
    assert first == draws() and 0 < sum(first) < 32


def test_fault_rate_outside_unit_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="corrupt_destination_rate"):
        FaultConfig(corrupt_destination_rate=1.5)


def _reference_checksum(block: torch.Tensor) -> int:
    x = block.reshape(-1).view(torch.int16).to(torch.int64)
    weights = torch.arange(x.numel(), dtype=torch.int64) % 65521 + 1
    a, b = int(x.sum()) & 0xFFFFFFFF, int((x * weights).sum()) & 0xFFFFFFFF
    return a << 32 | b


@pytest.mark.parametrize("segment_words", [1 << 21, 1000])
def test_checksum_matches_the_documented_formula(monkeypatch, segment_words: int) -> None:
    monkeypatch.setattr("engine.block_checksum._SEGMENT_WORDS", segment_words)
    kv = _kv()
    kv[3].reshape(-1).view(torch.int16)[:] = 32767  # extreme words: the largest partial sums
    assert block_checksums(kv, [3, 11]) == [_reference_checksum(kv[3]), _reference_checksum(kv[11])]
