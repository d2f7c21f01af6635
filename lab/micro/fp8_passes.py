"""Teacher-forced passes of the default model for the FP8 accuracy scripts (fp8_accuracy, fp8_sensitivity,
fp8_error_breakdown): the engine, one pass's logits, the prompt corpus, and bf16 GEMMs at float32 speed.

bf16 on a CPU without bf16 arithmetic (AVX-512 BF16 / AMX): PyTorch's bf16 matmul there multiplies the bf16
values in float32, accumulates in float32 and rounds the output to bf16 -- the arithmetic of a GPU's bf16
GEMM -- but through a slow path, 5-6x float32's time on the default model. `emulated_bf16_gemm` computes
the same thing through float32 GEMMs (a product of two bf16 values is exact in float32), so only the order
of accumulation differs from the native path. Everything else (norms, attention, RoPE) stays native bf16.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.config import BatcherConfig, CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.quant import fp8
from engine.sampling_params import SamplingParams
from loadtest.sharegpt import iter_records, open_sharegpt

PROMPT_CHARS = 300  # a user turn is cut to this many characters before the chat template


@dataclasses.dataclass(frozen=True)
class Corpus:
    prompts: list[list[int]]  # chat-templated first user turns
    continuations: list[list[int]]  # the baseline's greedy tokens after each prompt (its decode steps)
    # The baseline's top-1 at each continuation position of a teacher-forced pass over prompt + continuation:
    # the like-for-like reference (the same arithmetic as every variant's pass), position by position.
    references: list[list[int]]
    segments: list[list[int]]  # answer text for perplexity


def make_engine(dtype: str, quantization: str | None, kv_cache_dtype: str, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model="", dtype=dtype, quantization=quantization,
                                  cache=CacheConfig(kv_cache_dtype=kv_cache_dtype),
                                  batcher=BatcherConfig(max_num_seqs=max_num_seqs,
                                                        max_num_batched_tokens=max(2048, max_num_seqs))))


@contextlib.contextmanager
def emulated_bf16_gemm() -> Iterator[None]:
    """`F.linear` on bf16 inputs through float32 (see the module docstring); a lab switch."""
    native = F.linear

    def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002
        if input.dtype != torch.bfloat16 or input.is_cuda:
            return native(input, weight, bias)
        return native(input.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = native


@contextlib.contextmanager
def weight_only_rows(rows: int) -> Iterator[None]:
    """Run projections of up to `rows` tokens weight-only (a lab switch: the engine's threshold is fixed)."""
    saved = fp8.WEIGHT_ONLY_MAX_ROWS
    fp8.WEIGHT_ONLY_MAX_ROWS = rows
    try:
        yield
    finally:
        fp8.WEIGHT_ONLY_MAX_ROWS = saved


@torch.inference_mode()
def sequence_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """`[len(tokens), vocab]` float32 logits of one teacher-forced pass over `tokens` (the engine is idle,
    so its first blocks are free; the pass writes and then reads them, FP8 or not)."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner)  # one process: the default model needs no tensor parallelism
    n, bs = len(tokens), runner.kv_spec.block_size
    blocks = list(range(-(-n // bs)))

    def ints(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=runner.device)

    meta = AttentionMetadata(
        slot_mapping=ints(list(range(n)), torch.int64), query_start_loc=ints([0, n], torch.int32),
        seq_lens=ints([n], torch.int32), block_tables=ints([blocks], torch.int32),
        max_query_len=n, max_seq_len=n, query_lens_cpu=(n,), seq_lens_cpu=(n,))
    positions = ints(list(range(n)), torch.int64)
    hidden = runner.model(ints(tokens, torch.int64), positions, runner.kv_cache, meta)
    return runner.model.compute_logits(hidden).float()


def continuation_logits(engine: LLMEngine, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """`[len(continuation), vocab]`: the logits predicting each continuation token, given the prefix."""
    logits = sequence_logits(engine, prompt + continuation)
    return logits[len(prompt) - 1: len(prompt) - 1 + len(continuation)]


def _user_turns(records: Iterator[dict]) -> Iterator[str]:
    for record in records:
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and len(turns[0].get("value", "")) >= 40:
            yield turns[0]["value"][:PROMPT_CHARS]


def _answers(records: Iterator[dict]) -> Iterator[str]:
    for record in records:
        for turn in record.get("conversations") or []:
            if turn.get("from") == "gpt":
                yield turn.get("value", "")


def build_corpus(engine: LLMEngine, num_prompts: int, new_tokens: int, segments: int, seg_tokens: int) -> Corpus:
    """ShareGPT first user turns continued greedily by `engine` (the baseline), and answer segments."""
    tok = engine.tokenizer
    assert tok is not None
    with open_sharegpt() as stream:
        records = iter_records(stream, max_records=20000)
        turns = _user_turns(records)
        prompts = [tok.encode_chat([{"role": "user", "content": next(turns)}]) for _ in range(num_prompts)]
        texts: list[list[int]] = []
        for answer in _answers(records):
            if len(texts) == segments:
                break
            ids = tok.encode(answer, add_special_tokens=False)
            if len(ids) >= seg_tokens:
                texts.append(ids[:seg_tokens])
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    continuations = engine.generate(prompts, greedy)
    references = [continuation_logits(engine, p, c).argmax(-1).tolist()
                  for p, c in zip(prompts, continuations, strict=True)]
    return Corpus(prompts, continuations, references, texts)


@contextlib.contextmanager
def fp8_dot_rows(rows: int) -> Iterator[None]:
    """Run projections of up to `rows` tokens (past the weight-only size) through the Triton kernel with e4m3
    activations (a lab switch: the engine's threshold is fixed)."""
    saved = fp8.FP8_DOT_MAX_ROWS
    fp8.FP8_DOT_MAX_ROWS = rows
    try:
        yield
    finally:
        fp8.FP8_DOT_MAX_ROWS = saved
