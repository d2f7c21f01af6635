"""How a decode worker's batch changes over time, from what it reports: the sequences running now
(their remaining lengths, `WorkerSnapshot.running_remaining_tokens`), those waiting or routed since
its heartbeat, and the requests the scheduler keeps placing there (`WorkerLoad.arrival_rate`).

Two predictions rest on it (placement.py uses both): how long a newcomer waits for a decode slot
when all are taken (`slot_wait_s`), and how many sequences it decodes beside over its life, which
sets its TPOT (`life_batch`).
"""

from __future__ import annotations

from scheduler.core.cluster_view import WorkerLoad
from scheduler.core.cost_model import CostModel
from scheduler.core.prefill_load import decode_stretch, measured_share, prefill_share


def life_batch(decode: WorkerLoad, others: int, max_tokens: int, step_s: float) -> float:
    """The mean number of other sequences decoding beside a newcomer over its life (`max_tokens` steps
    of `step_s`), not only those there now: its TPOT is the mean of its steps.

    On the CPU policy runs the batch a request was placed into was a poor guess of the batch it
    decoded in: placed beside ~1 other sequence it decoded beside ~3-4, placed beside ~7 beside ~5-6
    (arrivals fill a quiet batch, the running sequences leave a full one), and the TPOT predicted from
    the batch at placement was 1.3-2x short and ~10% over respectively (docs/benchmarks.md, pass P).
    The sequences running now stay for the part of the newcomer's life their remaining length covers
    (remaining lengths spread evenly around their reported mean, as for slot waits); those waiting or
    routed since the heartbeat have not started and stay throughout; requests keep arriving at the
    worker's recent rate, each staying from its arrival to the newcomer's end (half the life on
    average). A worker that does not report remaining lengths keeps its running sequences throughout:
    without the arrivals that replace them (a scheduler just restarted knows none), assuming they
    leave would forecast a full batch draining. Capped at the slots the others can have.
    """
    started = min(decode.snapshot.running_seqs, others)
    remaining = mean_remaining_tokens(decode, started, step_s)
    survivors = started if remaining is None else started * _staying_fraction(remaining, max_tokens)
    arriving = decode.arrival_rate * max_tokens * step_s / 2
    total = survivors + (others - started) + arriving
    slots = decode.max_num_seqs
    return total if slots is None else min(total, slots - 1)


def _staying_fraction(mean_remaining: float, life: int) -> float:
    """The expected fraction of `life` steps a sequence stays, its remaining length uniform on
    (0, 2 * mean_remaining]: E[min(r, life)] / life."""
    if life <= 0:
        return 0.0
    if 2 * mean_remaining <= life:
        return mean_remaining / life
    return 1.0 - life / (4 * mean_remaining)


def mean_remaining_tokens(decode: WorkerLoad, running: int, step_s: float) -> float | None:
    """The mean tokens the `running` sequences still have to generate: what the worker reported (their
    max_tokens minus tokens out), less the steps of `step_s` (stretched) run since its heartbeat;
    None when the worker does not report it."""
    reported = decode.snapshot.running_remaining_tokens
    if reported <= 0 or running <= 0:
        return None
    return max(reported / running - decode.heartbeat_age_s / step_s, 0.0)


def running_batch(decode: WorkerLoad) -> int:
    """Sequences in the decode batch: all of them, or the slots' worth when some wait for one."""
    slots = decode.max_num_seqs
    return decode.decode_batch if slots is None else min(decode.decode_batch, slots)


def batch_context(decode: WorkerLoad, seqs: int) -> int:
    """Context of `seqs` of the worker's sequences, each at the batch's mean context."""
    if decode.decode_batch <= 0:
        return 0
    return decode.context_tokens * min(seqs, decode.decode_batch) // decode.decode_batch


def step_stretch(decode: WorkerLoad, cost: CostModel, step_s: float) -> float:
    """How much longer, wall clock, a step of `step_s` takes on the worker with the prompts arriving
    there folded into its steps (prefill_load.py): their chunks at the cost the worker's mixed steps
    measured, or, before it has reported any, the share forecast from their predicted compute (which
    depends on the step)."""
    folded = decode.folded_s_per_chunk
    if folded is None:
        share = prefill_share(decode.prefill_work_rate, decode.prefill_rate, cost.mixed_decode_share, step_s)
    else:
        share = measured_share(decode.prefill_chunk_rate, folded)
    return decode_stretch(share, decode.max_num_seqs)


def slot_wait_s(decode: WorkerLoad, cost: CostModel, max_tokens: int) -> float:
    """Predicted wait for a decode slot when all `max_num_seqs` are taken (0 otherwise).

    Slots free soonest first (`slot_free_steps`). The sequences ahead of this request (waiting in the
    worker, or routed there since its heartbeat: none has started) take them in that order, each for
    a whole lifetime L = `max_tokens` steps (the only length known), so the one `ahead` places in
    line gets the `ahead % S`-th slot to free after `ahead // S` such lifetimes. Steps are priced at
    a full batch.
    """
    slots = decode.max_num_seqs
    if slots is None or decode.decode_batch < slots:
        return 0.0
    running = min(decode.snapshot.running_seqs, slots)
    step = cost.decode_step_s(slots, batch_context(decode, slots))
    stretched = step * step_stretch(decode, cost, step)
    waves, position = divmod(decode.decode_batch - running, slots)
    return step * (slot_free_steps(decode, running, slots, position, max_tokens, stretched) + waves * max_tokens)


def slot_free_steps(
    decode: WorkerLoad, running: int, slots: int, nth: int, max_tokens: int, stretched_step_s: float
) -> float:
    """Decode steps until the `nth` (0-based) of the `slots` to free does: 0 for the free ones, which
    come first; then the `running` sequences' slots, spread evenly over (0, 2m], m being their mean
    remaining length. Computed directly, not by listing every slot: this runs per candidate per
    decision, and a GPU worker has hundreds of slots.

    m is what the worker reported (their max_tokens minus tokens out, less the steps run since the
    heartbeat, each stretched by the worker's prefill share). A worker that does not report it leaves m
    at L/2: the running sequences are taken to be as long as this request and uniformly far along. That
    guess sees a sequence that has just started as half done; decisions come right after heartbeats, when
    a slot has often just been refilled (measured on the CPU policy runs: one-slot TTFTs predicted at
    1.4-1.9 s came out 2.6-2.9 s).
    """
    j = nth - (slots - running) + 1  # the j-th running sequence to finish, 1-based; < 1: a free slot
    if j < 1:
        return 0.0
    mean = mean_remaining_tokens(decode, running, stretched_step_s)
    return 2 * (max_tokens / 2 if mean is None else mean) * j / (running + 1)
