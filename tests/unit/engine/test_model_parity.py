"""Our Llama-family model against Hugging Face transformers on tiny random models, through the paged cache.

Each family is a tiny random HF model; its state_dict is loaded into ours by HF names. The MoE
families (tests/support/tiny_moe.py) go through `save_pretrained` and our safetensors loader instead:
transformers 5 keeps experts stacked in memory, but checkpoints (and so our loader) name them per expert. Logits of a
prefill, of decode steps after it, of a 3-piece chunked prefill and of a mixed varlen batch must
match HF's full-sequence forward to 1e-3 of the logit scale (float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.required import require_module
from tests.support.tiny_moe import TINY_MOE_FAMILIES, build_tiny_moe, randomize

transformers = require_module("transformers")

from paged_harness import PagedHarness  # noqa: E402

from engine.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.errors import ConfigError, ModelLoadError  # noqa: E402
from engine.loader.weights import load_model_weights  # noqa: E402
from engine.models import get_model_class  # noqa: E402
from engine.models.llama import LlamaForCausalLM  # noqa: E402

TOLERANCE = 1e-3  # of max |HF logit|
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=32)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-rope-scaling": ("LlamaConfig", dict(SMALL, vocab_size=160, rope_parameters=LLAMA3_ROPE)),
    "llama-attention-bias": ("LlamaConfig", dict(SMALL, vocab_size=128, attention_bias=True)),
    "mistral": ("MistralConfig", dict(SMALL, vocab_size=192, num_hidden_layers=3, sliding_window=None)),
    "qwen2-qkv-bias": ("Qwen2Config", dict(SMALL, vocab_size=200, rope_parameters=dict(rope_theta=1e6))),
    "qwen3-qk-norm": ("Qwen3Config", dict(SMALL, vocab_size=256, head_dim=32)),
    "smollm2-tied": ("LlamaConfig", dict(SMALL, vocab_size=144, num_key_value_heads=1,
                                          tie_word_embeddings=True)),
}


def build_pair(family: str, tmp_dir: Path | None = None) -> tuple[torch.nn.Module, LlamaForCausalLM, ModelConfig]:
    """A seeded random HF model and ours, loaded from its state_dict (an MoE family: from its checkpoint,
    written to `tmp_dir`)."""
    if family in TINY_MOE_FAMILIES:
        assert tmp_dir is not None
        hf = build_tiny_moe(family, vocab_size=160)
        hf.save_pretrained(tmp_dir)
        config = ModelConfig.from_dir(tmp_dir)
        ours = get_model_class(config.architecture)(config, TorchAttentionBackend())
        assert isinstance(ours, LlamaForCausalLM)
        ours.load_weights(load_model_weights(tmp_dir, "safetensors", config, "float32"))
        return hf, ours, config
    config_cls, kwargs = FAMILIES[family]
    hf_config = getattr(transformers, config_cls)(**kwargs)
    hf_config.architectures = [config_cls.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    randomize(hf)
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    ours = get_model_class(config.architecture)(config, TorchAttentionBackend())
    assert isinstance(ours, LlamaForCausalLM)
    ours.load_weights(hf.state_dict().items())
    return hf, ours, config


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return (ours - expected).abs().max().item() / expected.abs().max().item()


def tokens_for(config: ModelConfig, n: int, seed: int) -> list[int]:
    return torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=[*FAMILIES, *TINY_MOE_FAMILIES])
def pair(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, LlamaForCausalLM, ModelConfig]:
    return build_pair(request.param, tmp_path_factory.mktemp(request.param))


def test_prefill_then_decode_matches_hf(pair: tuple[torch.nn.Module, LlamaForCausalLM, ModelConfig]) -> None:
    hf, ours, config = pair
    tokens = tokens_for(config, 24, seed=2)
    harness = PagedHarness(ours, config, block_size=4)
    got = [harness.step([("a", tokens[:20])])["a"]]
    got += [harness.step([("a", [t])])["a"] for t in tokens[20:]]
    assert relative_error(torch.cat(got), hf_logits(hf, tokens)) <= TOLERANCE


def test_chunked_prefill_matches_hf(pair: tuple[torch.nn.Module, LlamaForCausalLM, ModelConfig]) -> None:
    hf, ours, config = pair
    tokens = tokens_for(config, 23, seed=3)
    harness = PagedHarness(ours, config, block_size=4)
    got = [harness.step([("a", piece)])["a"] for piece in (tokens[:7], tokens[7:13], tokens[13:])]
    assert relative_error(torch.cat(got), hf_logits(hf, tokens)) <= TOLERANCE


def test_mixed_varlen_batch_matches_hf(pair: tuple[torch.nn.Module, LlamaForCausalLM, ModelConfig]) -> None:
    hf, ours, config = pair
    a, b, c = (tokens_for(config, n, seed=s) for n, s in ((18, 4), (25, 5), (9, 6)))
    harness = PagedHarness(ours, config, block_size=16)
    first = harness.step([("a", a[:17]), ("b", b[:11])])  # two prefills in one step
    second = harness.step([("b", b[11:]), ("a", a[17:]), ("c", c)])  # chunk + decode + prefill
    assert relative_error(torch.cat([first["a"], second["a"]]), hf_logits(hf, a)) <= TOLERANCE
    assert relative_error(torch.cat([first["b"], second["b"]]), hf_logits(hf, b)) <= TOLERANCE
    assert relative_error(second["c"], hf_logits(hf, c)) <= TOLERANCE


def _state(family: str) -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    hf, ours, _ = build_pair(family)
    return ours, dict(hf.state_dict())


def test_load_rejects_unknown_weight() -> None:
    ours, state = _state("mistral")
    state["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(1)
    with pytest.raises(ModelLoadError, match="extra_proj"):
        ours.load_weights(state.items())


def test_load_reports_missing_weights() -> None:
    ours, state = _state("qwen3-qk-norm")
    del state["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ModelLoadError, match="k_norm"):
        ours.load_weights(state.items())


def test_load_rejects_wrong_shape() -> None:
    ours, state = _state("qwen2-qkv-bias")
    state["model.layers.0.self_attn.v_proj.bias"] = torch.zeros(3)
    with pytest.raises(ModelLoadError, match="v_proj.bias"):
        ours.load_weights(state.items())


def test_tied_model_loads_without_lm_head() -> None:
    ours, state = _state("smollm2-tied")
    del state["lm_head.weight"]
    ours.load_weights(state.items())
    hidden = state["model.norm.weight"][None]
    assert torch.allclose(ours.compute_logits(hidden), hidden @ state["model.embed_tokens.weight"].T)


def test_registry_names_valid_architectures() -> None:
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")
