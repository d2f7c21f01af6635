"""`TorchEncoderLayers`: all-MiniLM-L6-v2's six encoder layers in torch, on a CUDA GPU (or the CPU, for tests).

Why: a 5,000-word prompt is ~170 GFLOP of encoder work; at 10 such requests a second that is
1.7 TFLOP/s, which the CPU cores of a GPU host (also feeding the GPU worker) cannot give, and a GPU
does in milliseconds. The math is `SentenceEncoder._encoder_layer`'s (BERT post-LN, exact erf GELU)
in float32, with TF32 matmuls off, so verdicts equal the CPU runtimes' (embeddings agree with the
numpy reference to ~1e-6, tested); the weights are the same pinned arrays, copied to the device once.

Only this module imports torch, and only `SentenceEncoder` with `EncoderRuntime.TORCH` imports this
module: the services image (no torch) never reaches it (pyproject.toml, contract "torch-free", which
names this one exception).

Thread-safe: the weights are read-only and each call allocates its own activations; calls from several
threads queue on the device's stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from services.common.errors import ConfigError

if TYPE_CHECKING:
    from services.safety.encoder_layer import EncoderLayer

F32 = npt.NDArray[np.float32]


class TorchDeviceUnavailableError(ConfigError):
    """The configured device (BATON_SAFETY_DEVICE, e.g. `cuda`) is not usable by this torch build."""


def check_device(device: str) -> torch.device:
    """The torch device named `device`; raises TorchDeviceUnavailableError when it cannot run here."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise TorchDeviceUnavailableError(f"{device!r} is not a torch device: {e}") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TorchDeviceUnavailableError(f"device {device!r}: torch {torch.__version__} sees no CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise TorchDeviceUnavailableError(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        raise TorchDeviceUnavailableError(f"device {device!r}: only cpu and cuda[:N] are supported")
    return dev


def cuda_visible() -> bool:
    """Whether torch can run on a CUDA GPU here (what `EncoderRuntime.AUTO` picks the GPU by)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


class TorchEncoderLayers:
    """`layers(x, bias)`: the encoder layers' output for embedded tokens `x` under attention `bias`."""

    def __init__(self, layers: Sequence[EncoderLayer], heads: int, device: str) -> None:
        self.device = check_device(device)
        # float32 as the numpy reference computes it: TF32 would move embeddings by ~1e-3.
        torch.backends.cuda.matmul.allow_tf32 = False
        self._heads = heads

        def put(a: F32) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(self.device)

        self._layers = [{name: put(getattr(layer, name)) for name in layer.__dataclass_fields__}
                        for layer in layers]

    @torch.inference_mode()
    def __call__(self, x: F32, bias: F32) -> F32:
        h = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(self.device, non_blocking=True)
        b = torch.from_numpy(np.ascontiguousarray(bias, dtype=np.float32)).to(self.device, non_blocking=True)
        for layer in self._layers:
            h = self._layer(h, layer, b)
        return h.cpu().numpy()

    def _layer(self, x: torch.Tensor, w: dict[str, torch.Tensor], bias: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        head_dim = dim // self._heads
        qkv = (x @ w["qkv_w"] + w["qkv_b"]).view(n, length, 3, self._heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [n, H, L, d] each
        scores = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(head_dim) + bias, dim=-1)
        attended = (scores @ v).transpose(1, 2).reshape(n, length, dim)
        x = F.layer_norm(x + attended @ w["out_w"] + w["out_b"], (dim,), w["ln1_g"], w["ln1_b"], eps=1e-12)
        hidden = F.gelu(x @ w["up_w"] + w["up_b"])  # exact (erf) GELU, BERT's
        return F.layer_norm(x + hidden @ w["down_w"] + w["down_b"], (dim,), w["ln2_g"], w["ln2_b"], eps=1e-12)
