"""The model's tokenizer: a `tokenizers.Tokenizer` plus its chat template (`chat_template.ChatTemplate`).

Why not `transformers.AutoTokenizer`: the serving path needs exactly three things -- the Rust BPE
(`tokenizers`), the chat template (`jinja2`) and a few special-token ids -- and `transformers`
brings ~1 s of import time, hundreds of MB of dependencies, and behaviour that shifts between major
versions (v5 changed `special_tokens_map`, chat-template file names and tokenizer classes). Here we
read the same files a HF directory holds (`tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`, `generation_config.json`), or a GGUF file's tokenizer metadata, so token ids
match it; tests compare against `AutoTokenizer` directly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from tokenization.chat_template import ChatTemplate, Message, find_chat_template
from tokenization.errors import InvalidRequestError, ModelLoadError
from tokenization.gguf_vocab import GGUFMetadata, build_tokenizer, tokenizer_config

SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"
)

__all__ = ["Message", "Tokenizer"]


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt, for one model. Immutable; thread-safe."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        # e.g. {"bos_token": "<|im_start|>"}; also the chat template's variables, as in transformers
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template) if chat_template else None
        eos = list(eos_token_ids)
        if (eos_id := self.token_to_id(self.special_tokens.get("eos_token"))) is not None:
            eos.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))  # ordered, unique
        self.bos_token_id: int | None = self.token_to_id(self.special_tokens.get("bos_token"))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory (needs `tokenizer.json`)."""
        d = Path(path)
        try:
            backend = BackendTokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # missing file or a tokenizer.json tokenizers cannot parse
            raise ModelLoadError(f"cannot load tokenizer.json from {d}: {e}") from e
        config = _read_json(d / "tokenizer_config.json")
        generation = _read_json(d / "generation_config.json") or _read_json(d / "config.json")
        return cls(
            backend,
            chat_template=find_chat_template(d, config),
            special_tokens=_special_tokens(config),
            eos_token_ids=_as_id_list(generation.get("eos_token_id")),
        )

    @classmethod
    def from_gguf(cls, gguf: GGUFMetadata) -> Tokenizer:
        """Build from an open GGUF file's tokenizer metadata (the engine's `open_gguf(path)`)."""
        config = tokenizer_config(gguf)
        return cls(
            build_tokenizer(gguf),
            chat_template=config.get("chat_template"),
            special_tokens=_special_tokens(config),
            eos_token_ids=_as_id_list(gguf.get("tokenizer.ggml.eos_token_id")),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what tokenizer.json's post-processor adds (BOS).

        Text that is not valid Unicode (a lone surrogate, which Python strings can hold but UTF-8 and
        the Rust tokenizer cannot) raises `InvalidRequestError`: it is the caller's input that is bad."""
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequestError(f"the text is not valid Unicode at position {e.start} "
                                          "(a lone surrogate)") from e
        # encode_batch, not encode: the Rust side then runs without the GIL, so a long prompt tokenised on
        # a worker thread does not stall the event loop that serves every other stream (a 2k-token prompt
        # held the gateway's loop ~10 ms with encode).
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary strings of `ids` (byte-level BPE spells a space 'Ġ'); `None` for unknown ids."""
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def backend_json(self) -> str:
        """The Rust tokenizer serialized as tokenizer.json (what grammar engines build their tables from)."""
        return self._backend.to_str()

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for a chat, rendered as `transformers`' `apply_chat_template(tokenize=False)` does."""
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; send a plain completion prompt",
                                      param="messages")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     variables={**self.special_tokens, **template_kwargs})

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat. The template writes its own BOS, so none is added here."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"invalid {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # older configs serialise AddedToken as {"content": ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
