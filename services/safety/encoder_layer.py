"""`EncoderLayer`: one MiniLM encoder layer's weights, as the numpy, ONNX and torch runtimes all take them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class EncoderLayer:
    """One encoder layer's float32 weights, matrices transposed for x @ w."""

    qkv_w: F32  # [384, 3*384] (transposed for x @ w)
    qkv_b: F32
    out_w: F32
    out_b: F32
    ln1_g: F32
    ln1_b: F32
    up_w: F32  # [384, 1536]
    up_b: F32
    down_w: F32  # [1536, 384]
    down_b: F32
    ln2_g: F32
    ln2_b: F32
