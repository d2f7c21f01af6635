"""A mixture-of-experts checkpoint is served like any Hugging Face directory: the gateway lists it
(`GET /v1/models` reads `GatewayConfig.models`) with the context window of its own config.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.settings import BatonSettings
from services.gateway.config import GatewayConfig
from services.gateway.settings import GatewaySettings
from tests.support.tiny_moe import save_tiny_moe


def test_moe_models_are_listed_by_name_with_their_context_windows(
        default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    qwen = save_tiny_moe("qwen3-moe", tmp_path / "qwen3-moe", default_model_dir)
    mixtral = save_tiny_moe("mixtral", tmp_path / "mixtral", default_model_dir)
    monkeypatch.setenv("BATON_EXTRA_MODELS", f'{{"tiny-mixtral": "{mixtral}"}}')
    built = GatewayConfig.from_settings(GatewaySettings(model=str(qwen), served_model_name="tiny-qwen3-moe"),
                                          BatonSettings())
    assert [(m.name, m.path, m.context_window) for m in built.models] == [
        ("tiny-qwen3-moe", qwen, 2048), ("tiny-mixtral", mixtral, 2048)]  # max_position_embeddings
