"""Seed cost-model profiles for registering workers, read from the `--profile` file.

`baton profile` measures one (model, hardware) pair and writes a single `WorkerProfile` JSON
object; a cluster serving several models can instead give one per model:

    {"SmolLM2-135M-Instruct": {...profile...}, "*": {...profile for any other model...}}

A worker with no matching entry starts from the core's default profile (pessimistic on purpose)
and converges on its own step samples within one cost window.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from scheduler.core.cost_model import WorkerProfile

_PROFILE_KEYS = frozenset(f.name for f in fields(WorkerProfile))
ANY_MODEL = "*"


@dataclass(frozen=True)
class ProfileBook:
    by_model: Mapping[str, WorkerProfile] = field(default_factory=dict)

    def for_model(self, model: str) -> WorkerProfile | None:
        """The model's profile, else the "*" one, else None (the core's default)."""
        return self.by_model.get(model, self.by_model.get(ANY_MODEL))

    @classmethod
    def from_data(cls, data: Any) -> ProfileBook:
        if not isinstance(data, dict) or not data:
            raise ValueError("a profile file holds a JSON object: one profile, or model name -> profile")
        if set(data) <= _PROFILE_KEYS:  # a bare profile applies to every model
            return cls({ANY_MODEL: WorkerProfile.from_dict(data)})
        book: dict[str, WorkerProfile] = {}
        for model, profile in data.items():
            if not isinstance(profile, dict):
                raise ValueError(f"profile for model {model!r} must be a JSON object")
            try:
                book[model] = WorkerProfile.from_dict(profile)
            except ValueError as e:
                raise ValueError(f"profile for model {model!r}: {e}") from e
        return cls(book)

    @classmethod
    def load(cls, path: str | Path) -> ProfileBook:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile file {path}: {e}") from e
        return cls.from_data(data)
