"""Vocab-parallel token embedding and LM head, with uninitialised storage (weights come from the checkpoint).

Rank r holds vocabulary rows `[r * per_rank, (r + 1) * per_rank)` with `per_rank = ceil(V / tp)`; the
last rank's rows past V are zero padding. The lookup zeroes the rows of ids other ranks hold and
all-reduces (each id is found on exactly one rank); the LM head multiplies by the local rows and
all-gathers the logits, then drops the padding columns. A tied model's head reuses the embedding's
shard, which is sharded the same way. With `TensorParallel()` (size 1) there is no padding and no
collective: the plain `F.embedding` / `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.linear import copy_checked
from engine.parallel.group import TensorParallel


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.per_rank
        self.num_valid = max(0, min(self.per_rank, vocab_size - self.vocab_start))  # rows past V are padding
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        foreign = (local < 0) | (local >= self.num_valid)
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)
        out.masked_fill_(foreign.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden] -> [N, V]` float32 logits against this table (the LM head, or a tied embedding)."""
        local = F.linear(hidden, self.weight)
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size].float()

    def load(self, kind: str, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the full HF `[V, hidden]` table; padding rows become zeros."""
        expected = (self.vocab_size, self.weight.shape[1])
        if kind != "weight" or tuple(tensor.shape) != expected:
            raise ModelLoadError(f"{kind}: checkpoint shape {tuple(tensor.shape)} != expected {expected}")
        copy_checked(self.weight.data[: self.num_valid], tensor.narrow(0, self.vocab_start, self.num_valid), kind)
        with torch.no_grad():
            self.weight.data[self.num_valid :].zero_()

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.weight.shape[1]}, rows {self.vocab_start}+{self.num_valid}"


class ParallelLMHead(VocabParallelEmbedding):
    """The untied output projection: only `logits` is used; sharded exactly as the embedding."""
