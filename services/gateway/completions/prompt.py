"""`PromptBuilder`: messages or text -> prompt token ids, checked against the context window.

Everything here runs before any worker is asked for anything, so an over-long request costs no GPU
work: the 400 names the limit and the count.

Conversation truncation policy (when a stored conversation is continued): the leading system
message(s) of the conversation and every message of the current request are always kept; of the
stored turns after the system prompt, the most recent ones that fit are kept, cut at a user message
so roles still alternate; "fit" means prompt + the room reserved for the completion (the request's
max_tokens, else the default) is within the context window. Found by binary search over the cut
point, so a long history costs O(log n) renders.

Length pre-check: no token of the vocabulary spells more than `max_token_chars` characters, so a
prompt of more than context_window * max_token_chars characters cannot fit whatever it says; it is
refused by `len()` alone, before templating or tokenizing (the request's own messages; stored
history is truncated instead). The methods here are CPU work (~1 s per MB of text): the service calls
them off the event loop (the tokenizer releases the GIL).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.config import ServedModel
from services.gateway.errors import BadRequestError, ContextWindowError, PromptTooLongError
from tokenization.block_hashes import block_hashes
from tokenization.tokenizer import Tokenizer

TemplateMessage = dict[str, str]


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    max_tokens: int  # the completion budget, resolved against the context window
    prefix_hashes: list[int]  # chained hashes of the prompt's full KV blocks (scheduler routing)
    text: str  # the prompt as text (echo; what the template rendered)
    dropped_messages: int = 0  # stored messages left out by truncation


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, model: ServedModel, block_size: int,
                 default_max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.block_size = block_size
        self.default_max_tokens = default_max_tokens
        self.max_token_chars = max(1, max((len(t) for t in tokenizer.convert_ids_to_tokens(
            range(tokenizer.vocab_size)) if t), default=1))

    def check_length(self, chars: int, param: str) -> None:
        """Refuse a prompt whose character count alone proves it cannot fit the context window."""
        window = self.model.context_window
        if chars > window * self.max_token_chars:
            raise PromptTooLongError(window, chars, -(-chars // self.max_token_chars), param)

    def chat(self, messages: Sequence[TemplateMessage], max_tokens: int | None,
             history: Sequence[TemplateMessage] = ()) -> PreparedPrompt:
        """The prompt for `history + messages`, dropping old history turns that don't fit."""
        self.check_length(sum(len(m["content"]) for m in messages), "messages")
        pinned, droppable = _split_system(history)
        reserve = max_tokens if max_tokens is not None else self.default_max_tokens
        budget = self.model.context_window - reserve
        cuts = _cut_points(droppable)  # ascending; the last one drops all of droppable

        def render(cut: int) -> tuple[str, list[int]]:
            chat = [*pinned, *droppable[cut:], *messages]
            text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
            return text, self.tokenizer.encode(text, add_special_tokens=False)

        lo, hi = 0, len(cuts) - 1  # find the first cut whose prompt fits the budget
        best = render(cuts[hi])
        if len(best[1]) <= budget:
            while lo < hi:
                mid = (lo + hi) // 2
                candidate = render(cuts[mid])
                if len(candidate[1]) <= budget:
                    hi, best = mid, candidate
                else:
                    lo = mid + 1
        # Nothing fits: keep the minimum (system + this request) and let _finish name the counts.
        return self._finish(best[0], best[1], max_tokens, "messages", cuts[hi])

    def text(self, prompt: str | list[int], max_tokens: int | None) -> PreparedPrompt:
        """A plain completion prompt: text (tokenized as the model's tokenizer.json says) or token ids."""
        if isinstance(prompt, str):
            self.check_length(len(prompt), "prompt")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            vocab = self.tokenizer.vocab_size
            if any(t >= vocab for t in prompt):
                raise BadRequestError(f"token ids must be < the vocabulary size {vocab}", "prompt")
            ids, text = list(prompt), self.tokenizer.decode(prompt)
        if not ids:
            raise BadRequestError("the prompt is empty", "prompt")
        return self._finish(text, ids, max_tokens, "prompt", 0)

    def _finish(self, text: str, ids: list[int], max_tokens: int | None, param: str,
                dropped: int) -> PreparedPrompt:
        window = self.model.context_window
        if max_tokens is None:
            room = window - len(ids)
            if room < 1:
                raise ContextWindowError(window, len(ids), 1, param)
            max_tokens = min(self.default_max_tokens, room)
        elif len(ids) + max_tokens > window:
            raise ContextWindowError(window, len(ids), max_tokens, param)
        return PreparedPrompt(ids, max_tokens, block_hashes(ids, self.block_size), text, dropped)


def _split_system(history: Sequence[TemplateMessage]) -> tuple[list[TemplateMessage], list[TemplateMessage]]:
    n = 0
    while n < len(history) and history[n]["role"] == "system":
        n += 1
    return list(history[:n]), list(history[n:])


def _cut_points(droppable: list[TemplateMessage]) -> list[int]:
    """Where the kept history may start: at 0, at every later user message, and at the end (keep none)."""
    cuts = [0] + [i for i, m in enumerate(droppable) if i > 0 and m["role"] == "user"]
    if cuts[-1] != len(droppable):
        cuts.append(len(droppable))
    return cuts
