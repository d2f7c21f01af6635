"""`tokenization.tokenizer.Tokenizer` must produce exactly what `transformers.AutoTokenizer` produces."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.required import require_module
from tokenization.errors import InvalidRequestError, ModelLoadError
from tokenization.tokenizer import Tokenizer

transformers = require_module("transformers")

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi ≈ 3.14159.",
    "Emoji: 🤖🚀 family 👨‍👩‍👧 flags 🇫🇷",
    "日本語のテキストと中文文本，还有한국어.",
    "  leading spaces,\ttabs\n\nand   runs of   spaces  ",
    "def f(x):\n    return x ** 2  # code\n",
    "Ünïcödé façade naïve café — “curly quotes” and ‘single’ …",
    "special <|im_start|>user\nhi<|im_end|> inside text",
    "I'm sure they've done it, haven't they? We'll see.",
    "",
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 🤖"},
        {"role": "assistant", "content": "Hello! 日本語?"},
        {"role": "user", "content": "Count: 1, 2, 3."},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second", "name": None},
        {"role": "user", "content": "third\n\nwith <b>markup</b> and \"quotes\""},
    ],
]


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def hf_tok(default_model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers_and_round_trips(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    gen = add_generation_prompt
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
    hf_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=gen, return_dict=True)["input_ids"]
    assert tok.encode_chat(messages, add_generation_prompt=gen) == hf_ids


def test_default_system_prompt_and_generation_prompt(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_special_ids_and_vocab(tok: Tokenizer, hf_tok: Any) -> None:
    assert tok.eos_token_ids == (hf_tok.eos_token_id,) == (2,)
    assert tok.bos_token_id == hf_tok.bos_token_id == 1
    assert tok.vocab_size == len(hf_tok) == 49152
    ids = tok.encode("Hello world 🤖")
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)


def test_gguf_tokenizer_equals_prepared_tokenizer(tok: Tokenizer) -> None:
    from engine.loader.gguf_file import open_gguf
    from engine.loader.prepare import default_gguf_path

    from_gguf = Tokenizer.from_gguf(open_gguf(default_gguf_path()))
    for text in TEXTS:
        assert from_gguf.encode(text) == tok.encode(text)
    assert from_gguf.encode_chat(CHATS[1]) == tok.encode_chat(CHATS[1])
    assert from_gguf.eos_token_ids == tok.eos_token_ids


# ---- template behaviour on custom templates ------------------------------------------------------
def with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok._backend, chat_template=template, special_tokens=tok.special_tokens,
                     eos_token_ids=tok.eos_token_ids)


def test_raise_exception_in_template_is_an_invalid_request(tok: Tokenizer) -> None:
    strict = with_template(tok, "{% if messages[0]['role'] != 'user' %}"
                                "{{ raise_exception('first message must be from the user') }}{% endif %}ok")
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_tojson_is_plain_json_like_transformers(tok: Tokenizer) -> None:
    t = with_template(tok, "{{ messages[0] | tojson }}|{{ tools | tojson(indent=2) }}")
    out = t.apply_chat_template([{"role": "user", "content": "<b>é</b>"}], tools=[{"name": "f"}])
    assert out == '{"role": "user", "content": "<b>é</b>"}|[\n  {\n    "name": "f"\n  }\n]'


def test_template_sees_special_tokens_and_generation_blocks(tok: Tokenizer) -> None:
    t = with_template(tok, "{{ bos_token }}{% for m in messages %}{% generation %}{{ m.content }}"
                           "{% endgeneration %}{% endfor %}{{ eos_token }}")
    assert t.apply_chat_template([{"role": "assistant", "content": "A"}]) == "<|im_start|>A<|im_end|>"


def test_sandbox_blocks_attribute_escapes(tok: Tokenizer) -> None:
    t = with_template(tok, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_is_an_invalid_request(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="no chat template"):
        with_template(tok, None).apply_chat_template([{"role": "user", "content": "x"}])


def test_broken_template_fails_at_load(tok: Tokenizer) -> None:
    with pytest.raises(ModelLoadError, match="does not compile"):
        with_template(tok, "{% for m in messages %}")


def test_chat_template_jinja_file_wins(default_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path)
    shutil.copy(default_model_dir / "tokenizer_config.json", tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }} messages")
    t = Tokenizer.from_dir(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "1 messages"


def test_missing_tokenizer_json_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
