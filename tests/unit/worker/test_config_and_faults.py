"""Worker configuration validation, the conditional-disaggregation policy and fault arming."""

from __future__ import annotations

import pytest

from kvtransfer.faults import Fault
from services.worker.config import DisaggPolicy, TransferConfig, WorkerConfig, WorkerRole
from services.worker.faults import WorkerFaults


def test_policy_prefills_short_and_mostly_cached_prompts_locally() -> None:
    policy = DisaggPolicy(min_remote_prompt_tokens=64, min_remote_uncached_tokens=32, max_cached_fraction=0.8)
    assert not policy.remote_by_length(63) and policy.remote_by_length(64)
    assert policy.remote_given_cache(200, 0)
    assert not policy.remote_given_cache(200, 176)  # 24 uncached tokens
    assert not policy.remote_given_cache(400, 320)  # 80 % cached
    assert policy.remote_given_cache(400, 304)


def test_quarantine_must_outlast_the_transfer_deadline() -> None:
    with pytest.raises(ValueError, match="quarantine_s .* must exceed transfer_timeout_s"):
        TransferConfig(transfer_timeout_s=10.0, quarantine_s=5.0)


def test_the_link_thread_poll_intervals_must_be_positive() -> None:
    with pytest.raises(ValueError, match="poll_quiet_s"):  # 0 would spin the link thread on the GIL
        TransferConfig(poll_quiet_s=0.0)


def test_prefill_peers_only_for_decode_workers() -> None:
    with pytest.raises(ValueError, match="--prefill-peers is for decode workers"):
        WorkerConfig(role=WorkerRole.BOTH, model_id="m", prefill_peers=("127.0.0.1:1",))


def test_arming_kv_and_worker_faults() -> None:
    faults = WorkerFaults()
    faults.arm("stall_transfer", times=2)
    faults.arm("delay_prefill", delay_s=1.5)
    assert [faults.kv.should_inject(Fault.STALL_TRANSFER) for _ in range(3)] == [True, True, False]
    assert (faults.take_prefill_delay(), faults.take_prefill_delay()) == (1.5, 0.0)


def test_unknown_fault_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: fail_transfer, stall_transfer"):
        WorkerFaults().arm("meteor")
    with pytest.raises(ValueError, match="delay_s > 0"):
        WorkerFaults().arm("delay_prefill")
