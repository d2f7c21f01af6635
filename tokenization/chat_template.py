"""A model's chat template: chat messages -> prompt text, rendered the way `transformers` renders it.

Chat templates are untrusted code from a model repo: they run in jinja2's immutable sandbox. Rendering
matches `transformers`' `apply_chat_template(tokenize=False)` -- `trim_blocks`/`lstrip_blocks`, its
`tojson`, `raise_exception`, `strftime_now`, `{% generation %}` -- so token ids match it. A template
that raises (e.g. "roles must alternate") surfaces as `InvalidRequestError` for the caller to return as
a 4xx; one that does not compile is the model's fault (`ModelLoadError`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenization.errors import InvalidRequestError, ModelLoadError

Message = dict[str, Any]


class ChatTemplate:
    """One compiled chat template. Immutable; thread-safe."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None,
        variables: dict[str, Any],
    ) -> str:
        """The prompt text; `variables` are the template's globals (special tokens, template kwargs).

        Message keys whose value is `None` are dropped first (as transformers does), so optional
        OpenAI fields such as `"name": None` do not reach the template.
        """
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=chat,
                tools=list(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:  # includes raise_exception(...) from the template itself
            raise InvalidRequestError(f"chat template rejected the messages: {e}", param="messages") from e


def find_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """The template source of a HF model directory: transformers 5 saves `chat_template.jinja`; older
    repos keep it in tokenizer_config.json, possibly as a list of named templates."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (assistant-mask markers) and render the body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template does not compile: {e}") from e


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes '<' and '>' and sorts keys; chat templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
