"""The synchronous engine: `add_request` / `step` / `abort`.

One step is three calls (nano-vllm's shape): the batcher plans, the model runner runs, the batcher
records the sampled tokens; then this class decides which requests finished (EOS, stop ids, stop
strings, max_tokens, context window) and turns the step into per-request output deltas.
Not thread-safe: `AsyncEngine` drives it from one thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.batch import SampledToken
from engine.batcher import Batcher
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """Engine-side state of a request beside the batcher's Sequence."""

    seq: Sequence
    detok: IncrementalDetokenizer | None
    stop_ids: frozenset[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = load_model(config.model, config.load_format, config.dtype, config.device,
                            seed=config.seed, cache_dir=config.cache_dir)
        self.model_config: ModelConfig = loaded.model_config
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        self.runner = ModelRunner(config, self.model_config, loaded.weights)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.batcher = Batcher(config.batcher, self.block_manager, self.max_model_len)
        self._requests: dict[str, _Tracked] = {}
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_token_ids)
        self._eos_ids = frozenset(eos)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises InvalidRequestError (and changes nothing) on bad input."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        try:
            self.batcher.add(seq)
        except Exception:
            del self._requests[request_id]
            raise

    def reserve_remote(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> tuple[list[int], int]:
        """Decode side of disaggregation: allocate blocks that a remote prefill will write into.

        Returns (block ids, prompt tokens already cached here). The request is not scheduled until
        `commit_remote`; `abort` releases its blocks at any time.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        try:
            return self.batcher.reserve_remote(seq)
        except Exception:
            self._requests.pop(request_id, None)
            raise

    def commit_remote(self, request_id: str, first_token_id: int) -> list[RequestOutput]:
        """The remote prefill's KV has landed: the sequence joins the decode batch with its first token."""
        self.batcher.commit_remote(request_id, first_token_id)
        tracked = self._requests[request_id]
        return [self._emit(tracked, [SampledToken(first_token_id)])]

    def abort(self, request_id: str) -> bool:
        """Abort at any state; every block of the request is released. Returns whether it existed."""
        tracked = self._requests.pop(request_id, None)
        existed = self.batcher.abort(request_id)
        return existed or tracked is not None

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def _new_sequence(self, request_id: str, prompt: list[int], params: SamplingParams) -> Sequence:
        self._validate(request_id, prompt, params)
        seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt), sampling=params)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, list(prompt), params.stop)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids)
        self._requests[request_id] = _Tracked(seq, detok, stop_ids)
        return seq

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if not prompt:
            raise InvalidRequestError("prompt is empty: at least one token is required")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; the context window is {self.max_model_len} tokens "
                "and at least one must be left to generate"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.batcher.schedule()
        if plan.is_empty:
            return []
        result = self.runner.execute(plan)
        self.batcher.postprocess(plan, result)
        outputs = []
        for request_id, sampled in result.sampled.items():
            tracked = self._requests.get(request_id)
            if tracked is not None:
                outputs.append(self._emit(tracked, [sampled]))
        return outputs

    def _emit(self, tracked: _Tracked, sampled: list[SampledToken]) -> RequestOutput:
        seq = tracked.seq
        token = sampled[-1].token_id
        text = tracked.detok.add(token) if tracked.detok is not None else ""
        reason = self._finish_reason(tracked, token)
        if reason is not None:
            if tracked.detok is not None and not tracked.detok.stopped:
                text += tracked.detok.flush()
            self.batcher.finish(seq.request_id, reason)
            del self._requests[seq.request_id]
        logprobs = tuple(s.logprobs for s in sampled if s.logprobs is not None)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tuple(s.token_id for s in sampled),
            new_text=text,
            logprobs=logprobs,
            finish_reason=reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _finish_reason(self, tracked: _Tracked, token: int) -> FinishReason | None:
        seq = tracked.seq
        if token in tracked.stop_ids:
            return FinishReason.STOP
        if tracked.detok is not None and tracked.detok.stopped:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= seq.sampling.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.batcher.max_num_tokens:  # context window (or the whole KV pool)
            return FinishReason.LENGTH
        return None

    # ---- conveniences ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (tests, CLI); returns each prompt's generated token ids."""
        ids = [f"gen-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._requests for rid in ids):
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]
