"""The gateway's served models: configuration (BATON_EXTRA_MODELS), lookup by name, and which
degraded-mode fallbacks it can answer with."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.billing.pricing import PriceTable
from services.common.errors import ConfigError
from services.common.settings import BatonSettings
from services.gateway import config
from services.gateway.completions.catalog import ModelCatalog, ModelRuntime
from services.gateway.completions.prompt import PreparedPrompt, PromptBuilder
from services.gateway.config import GatewayConfig, ServedModel
from services.gateway.errors import ModelNotFoundError, OverloadedError
from services.gateway.settings import GatewaySettings
from tokenization.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_dir(default_model_dir: Path) -> Path:
    from engine.loader.tiny import tiny_model_dir

    return tiny_model_dir(default_model_dir.parents[1])


def _runtime(path: Path, name: str, window: int | None = None) -> ModelRuntime:
    served = ServedModel.from_dir(path, name, window, PriceTable.from_settings(BatonSettings()))
    return ModelRuntime.of(PromptBuilder(Tokenizer.from_dir(path), served, 16, 64))


def _prompt(tokens: int, max_tokens: int) -> PreparedPrompt:
    return PreparedPrompt(list(range(tokens)), max_tokens, [], "")


def test_the_tiny_model_name_mirrors_the_engine_loader() -> None:
    from engine.loader import tiny

    assert config.TINY_MODEL_NAME == tiny.TINY_MODEL_NAME


def test_extra_models_are_served_beside_the_default_by_name(default_model_dir: Path, tiny_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cache = str(default_model_dir.parents[1])
    monkeypatch.setenv("BATON_EXTRA_MODELS", '{"tiny": "baton-tiny-random"}')
    built = GatewayConfig.from_settings(GatewaySettings(cache_dir=cache), BatonSettings())
    assert [(m.name, m.path) for m in built.models] == [(default_model_dir.name, default_model_dir), ("tiny", tiny_dir)]
    assert built.extra_models[0].context_window == 2048  # the tiny config's max_position_embeddings
    monkeypatch.setenv("BATON_EXTRA_MODELS", f'{{"{default_model_dir.name}": "baton-tiny-random"}}')
    with pytest.raises(ConfigError, match="the default model's name"):
        GatewayConfig.from_settings(GatewaySettings(cache_dir=cache), BatonSettings())


def test_an_unknown_model_is_a_404_naming_the_served_ones(default_model_dir: Path, tiny_dir: Path) -> None:
    catalog = ModelCatalog([_runtime(default_model_dir, "big"), _runtime(tiny_dir, "small")])
    assert catalog.get("small").name == "small" and catalog.names == ["big", "small"]
    with pytest.raises(ModelNotFoundError) as caught:
        catalog.get("gpt-4o")
    assert (caught.value.http_status, caught.value.code) == (404, "model_not_found")
    assert "['big', 'small']" in str(caught.value)
    with pytest.raises(ValueError, match="unique"):
        ModelCatalog([_runtime(tiny_dir, "small"), _runtime(tiny_dir, "small")])


def test_a_fallback_must_be_served_here_share_the_tokenizer_and_fit(default_model_dir: Path, tiny_dir: Path,
                                                                    tmp_path: Path) -> None:
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_dir, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"<|endoftext|>"',
                                                                                         '"<|end|>"', 1))
    catalog = ModelCatalog([_runtime(default_model_dir, "big"), _runtime(tiny_dir, "small", window=512),
                            _runtime(other, "other")])
    assert catalog.fallback("big", "small", [_prompt(100, 400)]).name == "small"
    for served, prompts in (("absent", [_prompt(10, 10)]), ("other", [_prompt(10, 10)]),
                            ("small", [_prompt(100, 400), _prompt(300, 400)])):
        with pytest.raises(OverloadedError) as caught:
            catalog.fallback("big", served, prompts)
        assert caught.value.http_status == 503
