"""What two workers must agree on before one writes into the other's KV blocks: `KVLayoutInfo`.

Each rank describes its KV cache this way in its handshake; its `compatibility_hash` and
`mismatches` are what kvtransfer/heads.py (another TP size) and kvtransfer/stages.py (another PP
size) and the peers' handshake (kvtransfer/base.py) compare.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

from engine.kv_cache import _DTYPE_BYTES as KV_DTYPE_BYTES  # TODO: engine to export it publicly
from engine.kv_cache import KVCacheSpec, KVLayout

# Bump when the notification format, the handshake fields or the layout meaning change.
# 2: the DONE notice carries the first token; checksums are computed by the engines, not the link.
KV_PROTOCOL_VERSION = 2
# engine.kv_cache's layout: kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
BLOCK_MAJOR_LAYOUT = "block_major_v1"
# The latent layout of MLA models: kv_cache[num_blocks, num_layers, 1, block_size, 1, latent_dim]. A
# different string, so a GQA worker and an MLA worker never agree on the compatibility hash.
BLOCK_MAJOR_LATENT_LAYOUT = "block_major_latent_v1"
_LAYOUT_NAMES = {KVLayout.KEY_VALUE: BLOCK_MAJOR_LAYOUT, KVLayout.LATENT: BLOCK_MAJOR_LATENT_LAYOUT}


@dataclass(frozen=True)
class KVLayoutInfo:
    """Everything two workers must agree on before one writes into the other's blocks."""

    protocol_version: int
    model_id: str
    dtype: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    tp_rank: int  # equal TP sizes: prefill rank r writes into decode rank r; else see kvtransfer/heads.py
    # Pipeline parallelism: this rank's stage, and its layers [first_layer, first_layer + num_layers)
    # of the model's (kvtransfer/stages.py: which rank of the peer holds them).
    pp_size: int = 1
    pp_rank: int = 0
    first_layer: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(KV_DTYPE_BYTES)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size", "pp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside [0, {self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} is outside [0, {self.pp_size})")
        if self.first_layer < 0:
            raise ValueError(f"first_layer must be >= 0, got {self.first_layer}")

    @property
    def world_rank(self) -> int:
        """This rank's place in its worker: stage * tp_size + tensor rank (engine/parallel/pipeline.py)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def layers(self) -> range:
        """The model's layers whose KV this rank holds."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, model_id: str, tp_size: int = 1, tp_rank: int = 0, pp_size: int = 1,
                  pp_rank: int = 0, first_layer: int = 0) -> KVLayoutInfo:
        """`spec` is this rank's KV cache (under pipeline parallelism: its stage's layers only)."""
        return cls(
            protocol_version=KV_PROTOCOL_VERSION,
            model_id=model_id,
            dtype=spec.dtype,
            layout=_LAYOUT_NAMES[spec.layout],
            block_size=spec.block_size,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
            first_layer=first_layer,
        )

    def to_spec(self) -> KVCacheSpec:
        layout = next((kind for kind, name in _LAYOUT_NAMES.items() if name == self.layout), None)
        if layout is None:
            raise ValueError(f"unknown KV layout {self.layout!r}; known: {', '.join(_LAYOUT_NAMES.values())}")
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            layout=layout,
        )

    @property
    def bytes_per_block(self) -> int:
        return self.to_spec().bytes_per_block

    def compatibility_hash(self) -> str:
        """Stable 16-hex-digit hash of every field; equal hashes mean the peers may exchange blocks."""
        items = sorted((f.name, getattr(self, f.name)) for f in fields(self))
        return hashlib.sha256(repr(items).encode()).hexdigest()[:16]

    def mismatches(self, other: KVLayoutInfo) -> list[tuple[str, object, object]]:
        """(field, mine, theirs) for every field that differs, in declaration order."""
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
