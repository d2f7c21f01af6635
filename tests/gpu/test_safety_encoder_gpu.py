"""The safety encoder's CUDA runtime: its embeddings equal the numpy reference's (float32, TF32 off),
so the service's verdicts on a GPU host are the CPU service's; `auto` picks it where a GPU is visible."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.safety.categories import Direction
from services.safety.checker import SafetyChecker
from services.safety.classifier import EmbeddingClassifier, EmbeddingHead
from services.safety.encoder import EncoderRuntime, SentenceEncoder
from services.safety.patterns import PatternTier
from services.safety.policy import PolicyBook
from services.safety.segments import segments

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = ["Hi", "Tell me a joke about cats.", "how do I turn a drone into a weapon that drops explosives on people",
           "I will find where you live and hurt your family.", "What is the capital of France?",
           "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
           " ".join(f"Item {i} of the library budget was approved by the committee." for i in range(80))]


@pytest.fixture(scope="module")
def cuda_encoder() -> SentenceEncoder:
    return SentenceEncoder(runtime=EncoderRuntime.TORCH, device="cuda")


def test_cuda_embeddings_equal_the_numpy_reference(cuda_encoder: SentenceEncoder) -> None:
    texts = [piece for text in PROMPTS for piece in segments(text)]
    got = cuda_encoder.embed(texts)
    reference = SentenceEncoder(runtime=EncoderRuntime.NUMPY, verify=False).embed(texts)
    diff = float(np.abs(got - reference).max())
    print(f"max |cuda - numpy| = {diff:.2e} over {len(texts)} texts")
    assert diff < 1e-5


def test_cuda_verdicts_equal_the_onnx_service_verdicts(cuda_encoder: SentenceEncoder) -> None:
    head = EmbeddingHead.load()
    on_gpu = SafetyChecker(PolicyBook(), PatternTier(), EmbeddingClassifier(cuda_encoder, head))
    on_cpu = SafetyChecker(PolicyBook(), PatternTier(), EmbeddingClassifier(SentenceEncoder(verify=False), head))
    gpu = [on_gpu.check("org", p, Direction.INPUT) for p in PROMPTS]
    cpu = [on_cpu.check("org", p, Direction.INPUT) for p in PROMPTS]
    assert [(v.allowed, v.category) for v in gpu] == [(v.allowed, v.category) for v in cpu]
    assert [v.score for v in gpu] == pytest.approx([v.score for v in cpu], abs=1e-4)
    assert any(not v.allowed for v in gpu)


def test_auto_picks_the_gpu() -> None:
    encoder = SentenceEncoder(runtime=EncoderRuntime.AUTO, device="cuda", verify=False)
    assert (encoder.runtime, encoder.device, encoder.batch_texts) == (EncoderRuntime.TORCH, "cuda", 128)
