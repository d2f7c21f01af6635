"""Speculative decoding: cheap drafts of several tokens, verified by the target model in one pass.

Per step, a decoding sequence that opted in (`SamplingParams.num_draft_tokens`) gets a draft from a
`DraftProposer` (today `NgramProposer`: prompt lookup). The batcher schedules its last known token
plus the draft as one chunk, like a small prefill over the paged KV; the model runner samples every
position of that chunk and `verify.accept_draft` keeps the longest prefix of the draft that the
target model agrees with, plus one token of the model's own. Rejected positions' KV slots are never
counted as computed, so the next step simply overwrites them.
"""

from engine.speculative.base import DraftProposer
from engine.speculative.ngram import NgramProposer

__all__ = ["DraftProposer", "NgramProposer"]
