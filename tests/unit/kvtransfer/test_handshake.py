"""Pure handshake / plan / notice logic (no NIXL needed)."""

from dataclasses import replace

import pytest

from engine.batch import TokenLogprobs
from engine.kv_cache import KVCacheSpec, KVLayout
from kvtransfer.base import HandoffPayload, HandshakeInfo, TransferPlan, TransferState
from kvtransfer.errors import IncompatiblePeerError, InvalidTransferPlanError, MalformedNotificationError
from kvtransfer.layout import KV_PROTOCOL_VERSION, KVLayoutInfo
from kvtransfer.nixl.descriptors import block_indices, block_rows
from kvtransfer.nixl.notification import NoticeKind, TransferNotice

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")


def _info(name: str = "peer", **layout_changes: object) -> HandshakeInfo:
    layout = replace(KVLayoutInfo.from_spec(SPEC, model_id="smollm2-135m"), **layout_changes)
    return HandshakeInfo(
        layout=layout,
        agent_name=name,
        agent_metadata=b"md",
        base_address=0x10000,
        num_blocks=64,
        bytes_per_block=layout.bytes_per_block,
        device_kind="cpu",
    )


def test_layout_from_spec_matches_engine_bytes_per_block() -> None:
    layout = KVLayoutInfo.from_spec(SPEC, model_id="m")
    assert layout.bytes_per_block == SPEC.bytes_per_block
    assert layout.protocol_version == KV_PROTOCOL_VERSION


def test_identical_layouts_are_compatible_and_hash_equal() -> None:
    local, peer = _info("local"), replace(_info("peer"), num_blocks=999, base_address=0x99000)
    local.check_compatible(peer)
    assert local.compatibility_hash() == peer.compatibility_hash()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 32),
        ("dtype", "float16"),
        ("num_kv_heads", 4),
        ("model_id", "llama-3-8b"),
        ("protocol_version", KV_PROTOCOL_VERSION + 1),
        ("tp_size", 2),
    ],
)
def test_mismatch_is_refused_naming_the_field_and_both_values(field: str, value: object) -> None:
    local, peer = _info("local"), _info("peer", **{field: value})
    with pytest.raises(IncompatiblePeerError) as err:
        local.check_compatible(peer)
    local_value = getattr(local.layout, field)
    assert f"{field}: local={local_value!r} peer={value!r}" in str(err.value)
    assert "'peer'" in str(err.value)


def test_every_mismatching_field_is_named() -> None:
    with pytest.raises(IncompatiblePeerError) as err:
        _info("local").check_compatible(_info("peer", block_size=32, head_dim=128))
    assert [m[0] for m in err.value.mismatches] == ["block_size", "head_dim"]


def _handshake(spec: KVCacheSpec, name: str) -> HandshakeInfo:
    layout = KVLayoutInfo.from_spec(spec, model_id="deepseek-v2-lite")
    return HandshakeInfo(layout=layout, agent_name=name, agent_metadata=b"md", base_address=0x10000, num_blocks=64,
                         bytes_per_block=layout.bytes_per_block, device_kind="cpu")


def test_a_latent_cache_worker_and_a_key_value_worker_are_refused() -> None:
    """Same model id, layers, heads, width and block size: only the layout differs (MLA's one latent
    plane against K and V planes), and that alone must keep their blocks apart."""
    latent = KVCacheSpec(27, 1, 576, 16, "bfloat16", KVLayout.LATENT)
    gqa = KVCacheSpec(27, 1, 576, 16, "bfloat16")
    mla_side, gqa_side = _handshake(latent, "mla"), _handshake(gqa, "gqa")
    assert mla_side.layout.compatibility_hash() != gqa_side.layout.compatibility_hash()
    assert mla_side.layout.bytes_per_block == latent.bytes_per_block == gqa.bytes_per_block // 2
    with pytest.raises(IncompatiblePeerError) as err:
        mla_side.check_compatible(gqa_side)
    assert [m[0] for m in err.value.mismatches] == ["layout"]
    assert mla_side.layout.to_spec() == latent


def test_an_unknown_layout_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV layout"):
        _info(layout="block_major_v9").layout.to_spec()


def test_hash_changes_with_any_layout_field() -> None:
    assert _info().compatibility_hash() != _info(num_layers=3).compatibility_hash()


def test_handshake_rejects_bytes_per_block_inconsistent_with_layout() -> None:
    with pytest.raises(ValueError, match="bytes_per_block"):
        replace(_info(), bytes_per_block=123)


def test_layout_rejects_unknown_dtype_listing_valid_ones() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        KVLayoutInfo.from_spec(replace(SPEC, dtype="int8"), model_id="m")


def test_layout_rejects_tp_rank_outside_tp_size() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        KVLayoutInfo.from_spec(SPEC, model_id="m", tp_size=2, tp_rank=2)


@pytest.mark.parametrize(
    ("local", "remote", "problem"),
    [
        ((1, 2), (3,), "local vs"),
        ((), (), "no blocks"),
        ((1, 1), (2, 3), "duplicate local"),
        ((1, 2), (3, 3), "duplicate remote"),
        ((-1,), (0,), "non-negative"),
    ],
)
def test_plan_rejects_malformed_block_lists(local: tuple, remote: tuple, problem: str) -> None:
    with pytest.raises(InvalidTransferPlanError, match=problem):
        TransferPlan("r1", local, remote, deadline=1.0)


def test_plan_create_sets_deadline_from_now_and_coerces_lists() -> None:
    plan = TransferPlan.create("r1", [4, 5], [7, 9], now=100.0, timeout_s=2.5, attempt=1)
    assert (plan.deadline, plan.local_block_ids, plan.tag) == (102.5, (4, 5), b"r1#1")


def test_terminal_states() -> None:
    terminal = {s for s in TransferState if s.is_terminal}
    assert terminal == {
        TransferState.DONE,
        TransferState.FAILED,
        TransferState.TIMED_OUT,
        TransferState.CANCELLED,
    }


def test_notice_round_trips_with_checksums() -> None:
    notice = TransferNotice(NoticeKind.DONE, "req-é/1", 2, 3, HandoffPayload(checksums=(0, 2**64 - 1, 42)))
    assert TransferNotice.decode(notice.encode()) == notice


def test_done_notice_round_trips_the_first_token_and_its_logprobs() -> None:
    logprobs = TokenLogprobs(17, -0.25, ((17, -0.25), (4, -1.5)))
    notice = TransferNotice(NoticeKind.DONE, "r", 0, 2, HandoffPayload((1, 2), 17, logprobs))
    assert TransferNotice.decode(notice.encode()).payload == HandoffPayload((1, 2), 17, logprobs)


def test_a_plan_refuses_checksums_that_do_not_cover_its_blocks() -> None:
    with pytest.raises(InvalidTransferPlanError, match="3 checksums for 2 blocks"):
        TransferPlan.create("r", [1, 2], [3, 4], now=0, timeout_s=1, payload=HandoffPayload((1, 2, 3)))


def test_abort_notice_round_trips_with_reason() -> None:
    notice = TransferNotice(NoticeKind.ABORTED, "r", 0, 1, reason="deadline passed")
    assert TransferNotice.decode(notice.encode()) == notice


@pytest.mark.parametrize(
    "raw", [b"hello", b"BKV2{not json", b'BKV2{"k":"done"}', b'BKV2{"k":"x","r":"a","a":0,"n":1}',
            b'BKV1{"k":"done","r":"a","a":0,"n":1}', b'BKV2{"k":"done","r":"a","a":0,"n":1,"lp":[1]}']
)
def test_foreign_notifications_are_malformed(raw: bytes) -> None:
    with pytest.raises(MalformedNotificationError):
        TransferNotice.decode(raw)


def test_block_rows_address_each_block() -> None:
    rows = block_rows(base_address=1000, num_blocks=3, bytes_per_block=64, device_id=1)
    assert rows.tolist() == [[1000, 64, 1], [1064, 64, 1], [1128, 64, 1]]


def test_block_indices_reject_out_of_range_ids_naming_the_side() -> None:
    with pytest.raises(InvalidTransferPlanError, match="remote block id 8 is outside the remote pool of 8"):
        block_indices([0, 8], num_blocks=8, side="remote")


def _group(tp_size: int, name: str = "peer") -> HandshakeInfo:
    """A tensor-parallel worker's handshake: rank 0 listing its follower ranks."""
    followers = tuple(replace(_info(f"{name}-tp{r}", tp_size=tp_size, tp_rank=r)) for r in range(1, tp_size))
    return replace(_info(name, tp_size=tp_size), ranks=followers)


def test_group_handshake_refuses_another_tp_size_naming_tp_size() -> None:
    with pytest.raises(IncompatiblePeerError, match="tp_size: local=2 peer=1"):
        _group(2, "local").check_group_compatible(_info("peer"))


def test_group_handshake_needs_every_follower_rank() -> None:
    rank0_only = _info("peer", tp_size=2)
    with pytest.raises(IncompatiblePeerError, match="ranks: local=1 peer=0"):
        _group(2, "local").check_group_compatible(rank0_only)
    _group(2, "local").check_group_compatible(_group(2))


def test_group_handshake_rejects_ranks_out_of_order() -> None:
    rank1 = _info("peer-tp1", tp_size=3, tp_rank=1)
    rank2 = _info("peer-tp2", tp_size=3, tp_rank=2)
    with pytest.raises(ValueError, match=r"ranks\[0\] is world rank 2 of TP3 x PP1"):
        replace(_info("peer", tp_size=3), ranks=(rank2, rank1))
