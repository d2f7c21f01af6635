"""How many parameters a model holds, and how many one token uses: the numbers behind memory and compute floors.

A mixture-of-experts model holds every expert but a token runs only its top-k: Qwen3-30B-A3B holds
~30.5B parameters and runs ~3.3B per token. Prefill FLOPs are 2 x the active matmul parameters per
token; a decode step reads the attention and dense weights once plus the experts the batch routed to
(between top_k and all of them per layer, depending on the batch), so both floors need the split.
Counts follow the checkpoint's tensors (engine/loader/dummy.py's `hf_parameter_shapes`), so they hold
for every family the engine serves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import ModelConfig
from engine.loader.dummy import hf_parameter_shapes


@dataclass(frozen=True)
class ParameterCount:
    attention: int  # q/k/v/o projections (+ biases, q/k norms), every layer
    dense_mlp: int  # the MLPs of dense layers
    expert: int  # one routed expert of one layer (gate + up + down)
    routed_experts: int  # every routed expert of every sparse layer
    shared: int  # routers, shared experts and their gates: every token uses them
    norms: int  # the layer norms and the final norm
    embedding: int  # vocab x hidden (a lookup: B rows are read per step, not the matrix)
    lm_head: int  # vocab x hidden, 0 when tied to the embedding (the embedding matrix is then read)
    sparse_layers: int
    top_k: int  # experts per token per sparse layer (0 for dense models)

    @property
    def head(self) -> int:
        """The LM head's matrix (the embedding's when tied)."""
        return self.lm_head or self.embedding

    @property
    def total(self) -> int:
        """Every parameter the checkpoint holds (what the GPU must store)."""
        return (self.attention + self.dense_mlp + self.routed_experts + self.shared + self.norms + self.embedding
                + self.lm_head)

    @property
    def active_layer_matmul(self) -> int:
        """Matmul parameters of the decoder layers one token runs through (top-k experts, not all):
        prefill FLOPs are 2 x this per token, plus the LM head for the rows that are sampled."""
        return self.attention + self.dense_mlp + self.sparse_layers * self.top_k * self.expert + self.shared

    @property
    def active(self) -> int:
        """Parameters one token uses, embedding row included: the 'A3B' of Qwen3-30B-A3B (~3.3B)."""
        return self.active_layer_matmul + self.norms + self.embedding + self.lm_head

    def weights_read(self, experts_routed_per_layer: float | None = None) -> int:
        """Parameters one forward pass reads when each sparse layer's batch routed to that many distinct
        experts (None: all of them). The embedding is left out: only the batch's rows are looked up."""
        routed = self.routed_experts if experts_routed_per_layer is None else round(
            self.sparse_layers * experts_routed_per_layer * self.expert)
        return self.attention + self.dense_mlp + self.shared + self.norms + self.head + routed


def count_parameters(config: ModelConfig) -> ParameterCount:
    sums = {"attention": 0, "dense_mlp": 0, "routed_experts": 0, "shared": 0, "norms": 0}
    for name, shape in hf_parameter_shapes(config).items():
        if not name.startswith("model.layers.") and name != "model.norm.weight":
            continue
        sums[_kind(name)] += math.prod(shape)
    moe = config.moe
    h, vocab = config.hidden_size, config.vocab_size
    return ParameterCount(
        **sums,
        expert=3 * h * moe.intermediate_size if moe else 0,
        embedding=vocab * h,
        lm_head=0 if config.tie_word_embeddings else vocab * h,
        sparse_layers=len(moe.sparse_layers) if moe else 0,
        top_k=moe.top_k if moe else 0,
    )


def _kind(name: str) -> str:
    if name.endswith("norm.weight") and "self_attn" not in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".experts." in name:
        return "routed_experts"
    if ".mlp." in name and not any(f".mlp.{p}." in name for p in ("gate_proj", "up_proj", "down_proj")):
        return "shared"  # router, shared expert and its gate (Qwen names the MoE block `mlp` too)
    if ".block_sparse_moe." in name:
        return "shared"  # Mixtral's router
    return "dense_mlp"
