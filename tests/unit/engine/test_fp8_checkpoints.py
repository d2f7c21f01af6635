"""FP8 weights end to end on CPU: hub-format FP8 checkpoints and online quantization load into the model,
hold exactly the stored e4m3 values and scales, and compute what the dequantized weights compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import ModelConfig
from engine.errors import ConfigError, ModelLoadError
from engine.layers.linear import Linear
from engine.loader import load_model_weights
from engine.loader.dummy import dummy_weights
from engine.models.llama import LlamaForCausalLM
from engine.quant.config import Fp8Config, resolve_fp8_config
from engine.quant.fp8 import FP8_DTYPE, dequantize_blocks, dequantize_rows, quantize_blocks, quantize_rows
from tests.unit.engine.paged_harness import PagedHarness

# Every projection width a multiple of 128, so the block format's merged q/k/v and gate/up stay aligned.
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 256, "intermediate_size": 384,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 128, "tie_word_embeddings": True,
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
    "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}}}}
TENSOR = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "weights": {"type": "float", "num_bits": 8, "strategy": "tensor"},
    "input_activations": {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}}}}
BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def _quantize(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors a hub checkpoint of `fmt` stores for one projection weight (suffixes only)."""
    if fmt == "block":
        q, s = quantize_blocks(w)
        return {"weight": q, "weight_scale_inv": s}
    if fmt == "tensor":
        scale = w.abs().max() / 448.0
        return {"weight": (w / scale).to(FP8_DTYPE), "weight_scale": scale.reshape(1),
                "input_scale": torch.tensor([0.05])}
    q, s = quantize_rows(w)
    return {"weight": q, "weight_scale": s.unsqueeze(1)}


def _dequantize(fmt: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    if fmt == "block":
        return dequantize_blocks(stored["weight"], stored["weight_scale_inv"])
    scale = stored["weight_scale"].reshape(-1).expand(stored["weight"].shape[0])
    return dequantize_rows(stored["weight"], scale)


def _write_checkpoint(path: Path, fmt: str | None, drop: str | None = None, unquantized: tuple[str, ...] = (),
                      ignore_list: dict[str, list[str]] | None = None) -> dict[str, torch.Tensor]:
    """An HF directory of `fmt` (None: float32); returns the weights the stored tensors stand for. The
    modules `unquantized` are stored in float32, and `ignore_list` goes into the quantization_config."""
    path.mkdir()
    config = ModelConfig.from_hf_config(HF_CONFIG)
    tensors, meaning = {}, {}
    for name, w in dummy_weights(config, torch.float32, seed=7):
        if fmt is None or not _is_projection(name) or name.removesuffix(".weight") in unquantized:
            tensors[name] = meaning[name] = w
            continue
        stored = _quantize(fmt, w)
        meaning[name] = _dequantize(fmt, stored)
        base = name.removesuffix(".weight")
        tensors.update({f"{base}.{suffix}": t for suffix, t in stored.items()})
    tensors.pop(drop, None)
    save_file(tensors, str(path / "model.safetensors"))
    qc = {"tensor": TENSOR, "channel": CHANNEL, "block": BLOCK}.get(fmt or "")
    qc = qc and {**qc, **(ignore_list or {})}
    (path / "config.json").write_text(json.dumps({**HF_CONFIG, **({"quantization_config": qc} if qc else {})}))
    return meaning


def _load(path: Path, quantization: str | None = None) -> LlamaForCausalLM:
    config = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    fp8 = resolve_fp8_config(quantization, config.fp8)
    if fp8 is not None:
        model.use_fp8(fp8)
    model.load_weights(load_model_weights(path, "safetensors", config, "float32"))
    return model


def _reference(meaning: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_hf_config(HF_CONFIG), TorchAttentionBackend())
    model.load_weights(meaning.items())
    return model


def _logits(model: LlamaForCausalLM) -> torch.Tensor:
    harness = PagedHarness(model, model.config, num_blocks=64)
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    return harness.step([("a", tokens)])["a"]


@pytest.mark.parametrize("fmt", ["tensor", "channel", "block"])
def test_hub_fp8_checkpoints_load_as_stored_and_match_their_dequantized_weights(tmp_path: Path, fmt: str) -> None:
    meaning = _write_checkpoint(tmp_path / fmt, fmt)
    model = _load(tmp_path / fmt)
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale is not None
    assert qkv.weight_scale.dim() == (2 if fmt == "block" else 1)
    dequantize = dequantize_blocks if fmt == "block" else dequantize_rows
    k_rows = dequantize(qkv.weight, qkv.weight_scale)[256:384]
    assert torch.equal(k_rows, meaning["model.layers.1.self_attn.k_proj.weight"])  # bit-exact storage
    down = model.model.layers[0].mlp.down_proj
    assert torch.equal(dequantize(down.weight, down.weight_scale), meaning["model.layers.0.mlp.down_proj.weight"])
    fp8_logits, ref_logits = _logits(model), _logits(_reference(meaning))
    # Only the per-token activation rounding separates the two.
    assert ((fp8_logits - ref_logits).norm() / ref_logits.norm()).item() < 0.05
    assert (fp8_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.9


LAYER0_QKV = tuple(f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj"))


@pytest.mark.parametrize(("fmt", "ignore_list"), [
    ("channel", {"ignore": ["lm_head", "model.layers.1.mlp.down_proj",
                            r"re:model\.layers\.0\.self_attn\.[qkv]_proj$"]}),
    ("block", {"modules_to_not_convert": ["lm_head", "layers.1.mlp.down_proj", "layers.0.self_attn.q_proj",
                                          "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj"]}),
    ("block", {"ignored_layers": ["layers.1.mlp.down", "layers.0.self_attn.q", "layers.0.self_attn.k",
                                  "layers.0.self_attn.v"]}),
])
def test_modules_a_checkpoint_leaves_unquantized_load_as_plain_layers(tmp_path: Path, fmt: str,
                                                                      ignore_list: dict[str, list[str]]) -> None:
    """compressed-tensors `ignore` (names, `re:` regexes) and `modules_to_not_convert` / `ignored_layers`
    (substrings): those projections hold the checkpoint's float weights exactly, the rest stay e4m3."""
    unquantized = (*LAYER0_QKV, "model.layers.1.mlp.down_proj")
    meaning = _write_checkpoint(tmp_path / fmt, fmt, unquantized=unquantized, ignore_list=ignore_list)
    model = _load(tmp_path / fmt)
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    assert layer0.self_attn.qkv_proj.weight_scale is None and layer1.mlp.down_proj.weight_scale is None
    assert torch.equal(layer0.self_attn.qkv_proj.weight[256:384], meaning["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(layer1.mlp.down_proj.weight, meaning["model.layers.1.mlp.down_proj.weight"])
    for kept in (layer0.self_attn.o_proj, layer0.mlp.down_proj, layer1.self_attn.qkv_proj, layer1.mlp.gate_up_proj):
        assert kept.weight.dtype == FP8_DTYPE
    fp8_logits, ref_logits = _logits(model), _logits(_reference(meaning))
    assert ((fp8_logits - ref_logits).norm() / ref_logits.norm()).item() < 0.05


def test_a_checkpoint_quantizing_only_part_of_a_merged_projection_is_refused(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "c", "channel", unquantized=("model.layers.0.self_attn.k_proj",),
                      ignore_list={"ignore": ["model.layers.0.self_attn.k_proj"]})
    with pytest.raises(ConfigError, match=r"leaves model\.layers\.0\.self_attn\.k_proj unquantized but not"):
        _load(tmp_path / "c")


def test_online_quantization_stores_per_channel_e4m3_of_the_float_weights(tmp_path: Path) -> None:
    meaning = _write_checkpoint(tmp_path / "float", None)
    model = _load(tmp_path / "float", quantization="fp8")
    gate_up = model.model.layers[0].mlp.gate_up_proj
    q, s = quantize_rows(meaning["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(gate_up.weight[384:].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(gate_up.weight_scale[384:], s)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # embeddings and norms stay as they were
    fp8_logits, ref_logits = _logits(model), _logits(_reference(meaning))
    assert ((fp8_logits - ref_logits).norm() / ref_logits.norm()).item() < 0.08


def test_a_stored_fp8_weight_without_its_scale_is_refused(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "c", "channel", drop="model.layers.1.self_attn.o_proj.weight_scale")
    with pytest.raises(ModelLoadError, match=r"self_attn\.o_proj.*no weight_scale"):
        _load(tmp_path / "c")


def test_fp8_scales_for_an_unquantized_model_are_refused(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "c", "channel")
    config = ModelConfig.from_hf_config(HF_CONFIG)  # built as if the checkpoint were bf16
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    with pytest.raises(ModelLoadError, match="built unquantized"):
        model.load_weights(load_model_weights(tmp_path / "c", "safetensors", config, "float32"))


def test_block_scales_that_do_not_match_the_configured_scaling_are_refused(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "b", "block")
    config = ModelConfig.from_dir(tmp_path / "b")
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    model.use_fp8(Fp8Config())  # per-row storage for a block-scaled checkpoint
    with pytest.raises(ModelLoadError, match="does not match the per_row FP8 scaling"):
        model.load_weights(load_model_weights(tmp_path / "b", "safetensors", config, "float32"))


def test_a_plain_linear_is_unchanged_by_the_fp8_support() -> None:
    layer = Linear(4, 3, bias=True)
    assert layer.weight_scale is None and "weight_scale" not in dict(layer.named_parameters())
