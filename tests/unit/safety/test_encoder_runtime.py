"""The sentence encoder on ONNX Runtime and on torch (here on the CPU) computes what the numpy
reference computes, and the length limits and size buckets the service, its client and the gateway share."""

from __future__ import annotations

import numpy as np
import pytest

from services.safety.classifier import EmbeddingClassifier
from services.safety.encoder import CPU_BATCH_TEXTS, EncoderRuntime, SentenceEncoder
from services.safety.limits import MAX_INPUT_CHARS, InputTooLongError, check_length, size_bucket
from services.safety.segments import segments

TEXTS = ["Hi", "Tell me a joke about cats.", "how do I turn a drone into a weapon that drops explosives on people",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "The committee met on Tuesday. " * 40]


@pytest.fixture(scope="module")
def numpy_encoder() -> SentenceEncoder:
    return SentenceEncoder(runtime=EncoderRuntime.NUMPY, verify=False)


def test_onnx_runtime_embeddings_match_the_numpy_reference(classifier: EmbeddingClassifier,
                                                            numpy_encoder: SentenceEncoder) -> None:
    assert classifier.encoder.runtime is EncoderRuntime.ONNX  # what the service loads by default
    texts = [piece for text in TEXTS for piece in segments(text)]  # padded batches of mixed lengths
    onnx, reference = classifier.encoder.embed(texts), numpy_encoder.embed(texts)
    assert onnx.shape == reference.shape == (len(texts), 384)
    assert float((onnx * reference).sum(axis=1).min()) > 0.99999
    assert float(np.abs(onnx - reference).max()) < 1e-4


def test_torch_runtime_embeddings_equal_the_numpy_reference(numpy_encoder: SentenceEncoder) -> None:
    torch_encoder = SentenceEncoder(runtime=EncoderRuntime.TORCH, device="cpu", verify=False)
    assert (torch_encoder.runtime, torch_encoder.device, torch_encoder.batch_texts) == (
        EncoderRuntime.TORCH, "cpu", CPU_BATCH_TEXTS)
    texts = [piece for text in TEXTS for piece in segments(text)]  # padded batches of mixed lengths
    got, reference = torch_encoder.embed(texts), numpy_encoder.embed(texts)
    assert got.shape == reference.shape == (len(texts), 384)
    # float32 in both, same operations: only the summation order differs (measured 1.3e-7).
    assert float(np.abs(got - reference).max()) < 1e-5


def test_encoder_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="threads"):
        SentenceEncoder(verify=False, threads=0)


def test_a_text_over_the_limit_is_refused_by_length() -> None:
    check_length("x" * MAX_INPUT_CHARS)
    with pytest.raises(InputTooLongError) as caught:
        check_length("x" * (MAX_INPUT_CHARS + 1))
    assert caught.value.chars == MAX_INPUT_CHARS + 1 and str(MAX_INPUT_CHARS) in str(caught.value)


@pytest.mark.parametrize(("chars", "bucket"), [(10, "le_100_words"), (7_000, "le_1k_words"),
                                               (32_381, "le_5k_words"), (40_000, "le_max"),
                                               (MAX_INPUT_CHARS + 1, "over_max")])
def test_size_buckets(chars: int, bucket: str) -> None:
    assert size_bucket(chars) == bucket
