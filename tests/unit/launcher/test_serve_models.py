"""`baton serve --model [NAME=]SOURCE`, repeatable: how the specs parse and what is refused."""

from __future__ import annotations

import argparse

import pytest

from services.common.errors import ConfigError
from services.launcher.models import ModelSpec
from services.launcher.serve import options_from_args, register_serve_command


def _options(*argv: str):  # noqa: ANN202 - ServeOptions
    parser = argparse.ArgumentParser()
    register_serve_command(parser.add_subparsers())
    return options_from_args(parser.parse_args(["serve", *argv]))


def test_models_parse_in_order_the_first_being_the_default() -> None:
    options = _options("--model", "SmolLM2-135M-Instruct", "--model", "tiny=baton-tiny-random", "--model", "/m/llama")
    assert options.models == (ModelSpec("SmolLM2-135M-Instruct"), ModelSpec("baton-tiny-random", "tiny"),
                              ModelSpec("/m/llama"))
    assert [(m.served_name, m.builtin) for m in options.models] == [
        ("SmolLM2-135M-Instruct", True), ("tiny", True), ("llama", False)]
    assert _options().models == ()  # the default model


@pytest.mark.parametrize(("argv", "message"), [
    (("--model", "=x"), "expected [NAME=]SOURCE"),
    (("--model", "/a/m", "--model", "/b/m"), "two models are named ['m']"),
    (("--model", "a", "--model", "b", "--no-scheduler"), "need the scheduler"),
])
def test_bad_model_lists_are_refused(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _options(*argv)
    assert message in str(caught.value)
