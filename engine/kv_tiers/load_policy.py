"""Whether loading a block from a lower tier beats recomputing it (no torch).

Loading one block costs `bytes_per_block / bandwidth(tier)`; recomputing it costs `block_size /
prefill_rate`. Both rates are measured on this worker: every finished load reports its bytes and
seconds per tier, every engine step its prefill tokens and seconds, each folded into an exponential
moving average. A tier whose load is slower than the recompute is skipped (the promotion stops at its
first block): a disk "hit" slower than the GPU's prefill would only add latency. `min_speedup` asks
for a margin (TierConfig.min_load_speedup). Until a rate has
been measured the prior given at start-up stands (the store measures host bandwidth once at
start-up); until the prefill rate is known loads are taken.
"""

from __future__ import annotations

import time

import torch

from engine.kv_tiers.types import KVTier

_ALPHA = 0.2  # weight of the newest sample: a few loads move the estimate, one outlier does not
_MIN_SAMPLE_S = 1e-6  # shorter samples carry no information (timer resolution)


class LoadCostModel:
    def __init__(self, bandwidth_prior: dict[KVTier, float], bytes_per_block: int, block_size: int,
                 min_speedup: float = 1.0) -> None:
        """`bandwidth_prior`: bytes/s per lower tier before any load was measured. `min_speedup`: how
        many times faster than the recompute a load must be estimated to be taken (0: always)."""
        self.min_speedup = min_speedup
        self._bandwidth = dict(bandwidth_prior)
        self._prefill_tokens_per_s: float | None = None
        self.bytes_per_block = bytes_per_block
        self.block_size = block_size

    def bandwidth(self, tier: KVTier) -> float:
        return self._bandwidth[tier]

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self._prefill_tokens_per_s

    def observe_load(self, tier: KVTier, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > _MIN_SAMPLE_S:
            self._bandwidth[tier] = _ewma(self._bandwidth[tier], num_bytes / seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > _MIN_SAMPLE_S:
            rate = num_tokens / seconds
            prev = self._prefill_tokens_per_s
            self._prefill_tokens_per_s = rate if prev is None else _ewma(prev, rate)

    def worth_loading(self, tier: KVTier) -> bool:
        """Whether one block of `tier` loads faster than its tokens prefill."""
        if self._prefill_tokens_per_s is None or self.min_speedup == 0:
            return True
        load_s = self.bytes_per_block / self._bandwidth[tier]
        recompute_s = self.block_size / self._prefill_tokens_per_s
        return load_s * self.min_speedup < recompute_s


def _ewma(prev: float, sample: float) -> float:
    return (1 - _ALPHA) * prev + _ALPHA * sample


def measure_host_bandwidth(kv_cache: torch.Tensor, host: torch.Tensor, bytes_per_block: int) -> float:
    """Bytes/s of one GPU -> host copy of up to 8 blocks: the host tier's load-cost prior."""
    n = min(8, host.shape[0], kv_cache.shape[0])
    if n == 0:
        return 1e10
    start = time.perf_counter()
    host[:n].copy_(kv_cache[:n])
    if kv_cache.is_cuda:
        torch.cuda.synchronize(kv_cache.device)
    return n * bytes_per_block / max(time.perf_counter() - start, 1e-6)
