"""`OnnxEncoderLayers`: all-MiniLM-L6-v2's six encoder layers run by ONNX Runtime instead of numpy.

Why: judging a long prompt is a forward pass over every one of its tokens (~22 MFLOP a token; a
5,000-word ShareGPT prompt is 7,860 tokens). The numpy pass spent ~45% of its time in the exact GELU (an erf
polynomial over [tokens, 1536] arrays, a dozen memory-bound passes) and ran on one thread. ONNX
Runtime fuses GELU, LayerNorm and the residual adds into single kernels and splits a batch across
`threads` intra-op threads: 1.8x less CPU and 1.8x less wall time for 5,000 words, measured on
the shared 2-core CI machine (docs/benchmarks.md, "Safety at any length").

The graph is built at start-up from the same float32 weights the numpy reference reads (no model
file is written or shipped; ~0.5 s), with standard opset-17 operators only: the embeddings and the
mean pooling stay in numpy (cheap), so the graph is x [n, L, 384] + an additive attention bias
[n, 1, 1, L] in, x out. Output agrees with the numpy reference to cosine >= 0.99999 (tested). Weights
stay float32: int8 dynamic quantization was measured (another ~1.5x) but moved embeddings to cosine
0.989 of the reference, off the classifier head's calibrated thresholds.

Thread-safe: `InferenceSession.run` may be called from several threads at once. The session's
threads do not spin while idle (`allow_spinning=0`): spinning threads took the cores from the
workers, as OpenBLAS's did (services/safety/server.py, `limit_blas_threads`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import onnx

    from services.safety.encoder_layer import EncoderLayer

F32 = npt.NDArray[np.float32]
_IR_VERSION = 9  # the newest IR version every onnxruntime >= 1.16 loads
_OPSET = 17      # LayerNormalization is a standard operator from opset 17


class _GraphBuilder:
    """Collects nodes and initializers; node outputs are named `<layer prefix><name>`."""

    def __init__(self, dim: int, heads: int) -> None:
        from onnx import numpy_helper

        self._to_tensor = numpy_helper.from_array
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.dim, self.heads = dim, heads
        head_dim = dim // heads
        self.const("qkv_shape", np.array([0, 0, 3, heads, head_dim], dtype=np.int64))  # 0: keep that dim
        self.const("model_shape", np.array([0, 0, dim], dtype=np.int64))
        self.const("scale", np.array(1.0 / math.sqrt(head_dim), dtype=np.float32))
        self.const("half", np.array(0.5, dtype=np.float32))
        self.const("one", np.array(1.0, dtype=np.float32))
        self.const("sqrt2", np.array(math.sqrt(2.0), dtype=np.float32))
        for j in range(3):
            self.const(f"index{j}", np.array(j, dtype=np.int64))

    def const(self, name: str, value: np.ndarray) -> str:
        # np.ascontiguousarray would turn a 0-d scalar (a Gather index) into shape [1].
        self.initializers.append(self._to_tensor(value if value.flags.c_contiguous else value.copy(order="C"), name))
        return name

    def node(self, op: str, inputs: Sequence[str], output: str, **attrs: int | float | list[int]) -> str:
        from onnx import helper

        node = helper.make_node(op, list(inputs), [output], name=output)
        node.attribute.extend(helper.make_attribute(key, value) for key, value in attrs.items())
        self.nodes.append(node)
        return output

    def linear(self, p: str, x: str, name: str, w: F32, b: F32) -> str:
        product = self.node("MatMul", [x, self.const(f"{p}{name}_w", w)], f"{p}{name}_mm")
        return self.node("Add", [product, self.const(f"{p}{name}_b", b)], f"{p}{name}")

    def attention(self, p: str, x: str, layer: EncoderLayer) -> str:
        qkv = self.node("Reshape", [self.linear(p, x, "qkv", layer.qkv_w, layer.qkv_b), "qkv_shape"], p + "qkv5")
        heads_first = self.node("Transpose", [qkv], p + "qkvT", perm=[2, 0, 3, 1, 4])  # [3, n, H, L, d]
        q, k, v = (self.node("Gather", [heads_first, f"index{j}"], f"{p}qkv{j}", axis=0) for j in range(3))
        scores = self.node("MatMul", [q, self.node("Transpose", [k], p + "kT", perm=[0, 1, 3, 2])], p + "scores")
        scores = self.node("Add", [self.node("Mul", [scores, "scale"], p + "scaled"), "bias"], p + "masked")
        probs = self.node("Softmax", [scores], p + "probs", axis=-1)
        attended = self.node("Transpose", [self.node("MatMul", [probs, v], p + "av")], p + "avT", perm=[0, 2, 1, 3])
        return self.node("Reshape", [attended, "model_shape"], p + "attended")

    def layer_norm(self, p: str, x: str, name: str, g: F32, b: F32) -> str:
        return self.node("LayerNormalization", [x, self.const(f"{p}{name}_g", g), self.const(f"{p}{name}_b", b)],
                         p + name, axis=-1, epsilon=1e-12)

    def gelu(self, p: str, x: str) -> str:
        # The exact (erf) GELU, written as the pattern ONNX Runtime fuses into one Gelu kernel.
        erf = self.node("Erf", [self.node("Div", [x, "sqrt2"], p + "gelu_div")], p + "gelu_erf")
        return self.node("Mul", [self.node("Mul", [x, "half"], p + "gelu_half"),
                                 self.node("Add", [erf, "one"], p + "gelu_add")], p + "gelu")

    def encoder_layer(self, i: int, x: str, layer: EncoderLayer) -> str:
        """BERT's post-LN layer, as `SentenceEncoder._encoder_layer` computes it."""
        p = f"layer{i}_"
        attended = self.linear(p, self.attention(p, x, layer), "out", layer.out_w, layer.out_b)
        x = self.layer_norm(p, self.node("Add", [x, attended], p + "res1"), "ln1", layer.ln1_g, layer.ln1_b)
        hidden = self.gelu(p, self.linear(p, x, "up", layer.up_w, layer.up_b))
        down = self.linear(p, hidden, "down", layer.down_w, layer.down_b)
        return self.layer_norm(p, self.node("Add", [x, down], p + "res2"), "ln2", layer.ln2_g, layer.ln2_b)


def build_encoder_graph(layers: Sequence[EncoderLayer], dim: int, heads: int) -> onnx.ModelProto:
    """The encoder layers as an ONNX model: inputs x [n, L, dim], bias [n, 1, 1, L]; output y [n, L, dim]."""
    from onnx import TensorProto, helper

    builder = _GraphBuilder(dim, heads)
    x = "x"
    for i, layer in enumerate(layers):
        x = builder.encoder_layer(i, x, layer)
    builder.nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(
        builder.nodes, "all_minilm_l6_v2_layers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "length", dim]),
         helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["n", 1, 1, "length"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "length", dim])], builder.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], ir_version=_IR_VERSION)


class OnnxEncoderLayers:
    """`layers(x, bias)`: the encoder layers' output for embedded tokens `x` under attention `bias`."""

    def __init__(self, layers: Sequence[EncoderLayer], dim: int, heads: int, threads: int) -> None:
        import onnxruntime as ort

        if threads < 1:
            raise ValueError(f"encoder threads must be >= 1, got {threads}")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        model = build_encoder_graph(layers, dim, heads).SerializeToString()
        self._session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])

    def __call__(self, x: F32, bias: F32) -> F32:
        (y,) = self._session.run(["y"], {"x": np.ascontiguousarray(x, dtype=np.float32),
                                         "bias": np.ascontiguousarray(bias, dtype=np.float32)})
        return np.asarray(y, dtype=np.float32)
