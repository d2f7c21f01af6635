"""Model loading: the prepared default model, GGUF vs transformers, safetensors, dummy weights, errors."""

from __future__ import annotations

import json
import time
from itertools import islice
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.errors import ConfigError, ModelLoadError
from engine.loader import (
    default_model_dir,
    detect_format,
    load_model,
    load_model_config,
    load_model_weights,
    resolve_model,
)
from engine.loader import prepare as prepare_module
from engine.loader.dummy import DUMMY_STD, dummy_weights, hf_parameter_shapes
from engine.loader.gguf_file import open_gguf
from engine.loader.gguf_weights import unpermute_rotary
from engine.loader.prepare import MARKER_FILE, default_gguf_path
from tests.support.required import require_module
from tokenization.tokenizer import Tokenizer

TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="module")
def prepared_config(default_model_dir: Path) -> ModelConfig:
    return load_model_config(default_model_dir)


def tiny_dir(tmp_path: Path, **overrides: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, **overrides}))
    return tmp_path


# ---- the prepared default model ------------------------------------------------------------------
def test_prepared_dir_holds_an_hf_model(default_model_dir: Path, prepared_config: ModelConfig) -> None:
    names = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", MARKER_FILE} <= names
    c = prepared_config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 64)
    assert (c.vocab_size, c.tie_word_embeddings, c.rope_theta, c.eos_token_ids) == (
        49152, True, 100000.0, (2,))
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_prepared_weights_are_float32_in_hf_names_and_shapes(
    default_model_dir: Path, prepared_config: ModelConfig
) -> None:
    tensors = load_file(default_model_dir / "model.safetensors")
    expected = hf_parameter_shapes(prepared_config)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert {v.dtype for v in tensors.values()} == {torch.float32}


def test_second_call_returns_the_prepared_dir_immediately(default_model_dir: Path) -> None:
    start = time.perf_counter()
    again = default_model_dir.parent.parent / "models" / default_model_dir.name
    assert prepare_module.default_model_dir(default_model_dir.parent.parent) == again
    assert time.perf_counter() - start < 0.5


def test_transformers_loads_prepared_dir_and_answers_paris(default_model_dir: Path) -> None:
    """Proves names, tying and the q/k unpermutation: a wrong permutation still loads but babbles."""
    transformers = require_module("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


# ---- GGUF ----------------------------------------------------------------------------------------
def test_gguf_config_equals_prepared_config(gguf_path: Path, prepared_config: ModelConfig) -> None:
    assert load_model_config(gguf_path, "gguf") == prepared_config


def test_gguf_weights_equal_prepared_weights(
    gguf_path: Path, default_model_dir: Path, prepared_config: ModelConfig
) -> None:
    prepared = load_file(default_model_dir / "model.safetensors")
    for name, tensor in islice(load_model_weights(gguf_path, "gguf", prepared_config, torch.float32), 12):
        assert torch.equal(tensor, prepared[name]), name


def test_unpermute_matches_transformers_gguf_processor(gguf_path: Path, prepared_config: ModelConfig) -> None:
    """Our q/k unpermutation against transformers' own GGUF loader, on the raw dequantized rows."""
    require_module("transformers")
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    gfile = open_gguf(gguf_path)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    cases = (("blk.0.attn_q.weight", 9), ("blk.0.attn_k.weight", 3), ("blk.29.attn_k.weight", 3))
    for gguf_name, heads in cases:
        t = gfile.tensors[gguf_name]
        raw = dequantize(t.data, t.tensor_type)
        theirs = torch.from_numpy(processor.process(weights=raw, name=gguf_name).weights.copy())
        ours = unpermute_rotary(torch.from_numpy(raw.copy()), heads)
        assert torch.equal(ours, theirs), gguf_name
        assert not torch.equal(ours, torch.from_numpy(raw)), "the file's rows really are permuted"


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.randn(3 * 8, 5)  # 3 heads, head_dim 8
    permuted = w.reshape(3, 2, 4, 5).transpose(1, 2).reshape(24, 5)  # llama.cpp's permute
    assert torch.equal(unpermute_rotary(permuted, 3), w)


def test_truncated_real_gguf_raises_model_load_error(gguf_path: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(gguf_path.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model_config(truncated)


def write_tiny_gguf(path: Path, hf_weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """A LLaMA GGUF as llama.cpp's converter writes one: GGUF names, q/k rows permuted, F32 tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    tokens = ["<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "\u0120", "ab", "\u0120a"]
    tokens += [f"<unused{i}>" for i in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["a b", "\u0120 a"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_layers)
    for hf_name, tensor in hf_weights.items():
        if ".q_proj." in hf_name or ".k_proj." in hf_name:
            heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads
            out, rest = tensor.shape[0], tensor.shape[1:]
            tensor = tensor.reshape(heads, 2, out // heads // 2, *rest).transpose(1, 2).reshape(tensor.shape)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), tensor.numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    config = ModelConfig.from_hf_config(TINY_HF_CONFIG)
    weights = dict(dummy_weights(config, torch.float32, seed=3))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, weights, config)
    return path, weights


def test_tiny_gguf_round_trips_config_and_unpermuted_weights(tiny_gguf: tuple[Path, dict]) -> None:
    path, original = tiny_gguf
    config = load_model_config(path)
    assert config == ModelConfig.from_hf_config({**TINY_HF_CONFIG, "bos_token_id": 0, "eos_token_id": 1,
                                                 "head_dim": 8, "rope_theta": 10000.0, "rms_norm_eps": 1e-5})
    loaded = dict(load_model_weights(path, "auto", config, torch.float32))
    assert set(loaded) == set(original)  # untied: lm_head comes from output.weight
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name


def test_gguf_tokenizer_adds_bos_when_the_file_says_so(tiny_gguf: tuple[Path, dict]) -> None:
    tok = Tokenizer.from_gguf(open_gguf(tiny_gguf[0]))
    assert tok.encode("ab a") == [0, tok.token_to_id("ab"), tok.token_to_id("\u0120a")]
    assert tok.encode("ab", add_special_tokens=False) == [tok.token_to_id("ab")]
    assert (tok.bos_token_id, tok.eos_token_ids) == (0, (1,))


@pytest.mark.parametrize("fraction", [0.002, 0.05, 0.3, 0.6, 0.95])
def test_truncated_gguf_raises_model_load_error(
    tiny_gguf: tuple[Path, dict], tmp_path: Path, fraction: float
) -> None:
    data = tiny_gguf[0].read_bytes()
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelLoadError):
        config = load_model_config(truncated)
        list(load_model_weights(truncated, "gguf", config, torch.float32))


# ---- safetensors ---------------------------------------------------------------------------------
def test_safetensors_dir_loads_in_requested_dtype(
    default_model_dir: Path, prepared_config: ModelConfig
) -> None:
    weights = dict(islice(load_model_weights(default_model_dir, "auto", prepared_config, "bfloat16"), 20))
    assert set(weights) <= set(hf_parameter_shapes(prepared_config))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_sharded_safetensors_follow_the_index(tmp_path: Path) -> None:
    d = tiny_dir(tmp_path)
    save_file({"a.weight": torch.ones(2)}, d / "model-00001-of-00002.safetensors")
    save_file({"b.weight": torch.zeros(3)}, d / "model-00002-of-00002.safetensors")
    save_file({"stray.weight": torch.ones(1)}, d / "consolidated.safetensors")
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "b.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    config = load_model_config(d)
    names = [name for name, _ in load_model_weights(d, "safetensors", config, torch.float32)]
    assert sorted(names) == ["a.weight", "b.weight"]


def test_unsharded_safetensors_without_index_load_every_file(tmp_path: Path) -> None:
    d = tiny_dir(tmp_path)
    save_file({"a.weight": torch.ones(2)}, d / "one.safetensors")
    save_file({"b.weight": torch.ones(2)}, d / "two.safetensors")
    names = [n for n, _ in load_model_weights(d, "auto", load_model_config(d), torch.float16)]
    assert sorted(names) == ["a.weight", "b.weight"]


def test_garbage_safetensors_fail_when_loading_starts(tmp_path: Path) -> None:
    d = tiny_dir(tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    with pytest.raises(ModelLoadError, match="not a valid safetensors file"):
        load_model_weights(d, "auto", load_model_config(d), torch.float32)


# ---- dummy ---------------------------------------------------------------------------------------
def test_dummy_weights_are_seeded_and_shaped(tmp_path: Path) -> None:
    d = tiny_dir(tmp_path)
    config = load_model_config(d, "dummy")
    a = dict(load_model_weights(d, "dummy", config, torch.bfloat16, seed=7))
    b = dict(load_model_weights(d, "dummy", config, torch.bfloat16, seed=7))
    c = dict(load_model_weights(d, "dummy", config, torch.bfloat16, seed=8))
    assert {k: tuple(v.shape) for k, v in a.items()} == hf_parameter_shapes(config)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert {v.dtype for v in a.values()} == {torch.bfloat16}
    assert torch.equal(a["model.norm.weight"], torch.ones(32, dtype=torch.bfloat16))
    assert abs(a["lm_head.weight"].float().std().item() - DUMMY_STD) < 0.003


def test_dummy_tensor_values_do_not_depend_on_the_rest_of_the_model(tmp_path: Path) -> None:
    small = ModelConfig.from_hf_config(TINY_HF_CONFIG)
    deep = ModelConfig.from_hf_config({**TINY_HF_CONFIG, "num_hidden_layers": 5})
    name = "model.layers.1.mlp.up_proj.weight"
    w_small = dict(load_model_weights(tiny_dir(tmp_path), "dummy", small, torch.float32))[name]
    w_deep = dict(load_model_weights(tmp_path, "dummy", deep, torch.float32))[name]
    assert torch.equal(w_small, w_deep)


# ---- format detection and errors -----------------------------------------------------------------
def test_detect_format(default_model_dir: Path, gguf_path: Path) -> None:
    assert detect_format(default_model_dir) == "safetensors"
    assert detect_format(gguf_path) == "gguf"


def test_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_config(tmp_path / "nope")


def test_config_only_dir_needs_dummy(tmp_path: Path) -> None:
    d = tiny_dir(tmp_path)
    with pytest.raises(ModelLoadError, match="load_format='dummy'"):
        detect_format(d)
    assert load_model_config(d, "dummy").num_layers == 2


def test_dir_without_config_raises(tmp_path: Path) -> None:
    save_file({"a.weight": torch.ones(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no config.json"):
        detect_format(tmp_path)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model_config(tmp_path, "dummy")


def test_non_gguf_file_raises(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"PK\x03\x04 pickle zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        detect_format(f)


def test_explicit_format_must_match_the_path(default_model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="holds a safetensors model"):
        load_model_config(default_model_dir, "gguf")
    with pytest.raises(ConfigError, match="valid: auto, safetensors, gguf, dummy"):
        load_model_config(default_model_dir, "pt")


# ---- resolving and preparing ---------------------------------------------------------------------
def test_resolve_model(default_model_dir: Path, gguf_path: Path) -> None:
    cache_root = default_model_dir.parent.parent
    assert resolve_model(None, cache_dir=cache_root) == (default_model_dir, "safetensors")
    assert resolve_model("SmolLM2-135M-Instruct", cache_dir=cache_root) == (default_model_dir, "safetensors")
    assert resolve_model(str(gguf_path)) == (gguf_path, "gguf")


def test_load_model_bundles_config_tokenizer_and_weights(default_model_dir: Path) -> None:
    loaded = load_model(default_model_dir, dtype="float32")
    assert loaded.load_format == "safetensors"
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token_ids == (2,)
    name, tensor = next(loaded.weights)
    assert tensor.dtype == torch.float32 and name.startswith("model.")


def test_crashed_prepare_leaves_no_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(prepare_module, "convert_gguf_to_hf_dir", crash)
    with pytest.raises(RuntimeError):
        default_model_dir(tmp_path)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_prepare_sweeps_stale_temp_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "models" / ".SmolLM2-135M-Instruct.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    monkeypatch.setattr(prepare_module, "convert_gguf_to_hf_dir", lambda gguf, out: None)
    target = default_model_dir(tmp_path)
    assert target == tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert (target / MARKER_FILE).is_file() and not stale.exists()
