"""Typed engine errors. Callers at process edges map these to gRPC status / OpenAI error JSON.

The root and the two errors the tokenizer raises too live in the torch-free ground floor
(`tokenization.errors`, shared with the gateway); the engine knows the root as `EngineError`.
"""

from tokenization.errors import InvalidRequestError, ModelLoadError
from tokenization.errors import ModelError as EngineError

__all__ = ["ConfigError", "EngineError", "InvalidRequestError", "ModelLoadError", "OutOfBlocksError"]


class ConfigError(EngineError, ValueError):
    """A configuration value is invalid; the message lists the valid choices."""


class OutOfBlocksError(EngineError):
    """The KV block pool cannot satisfy an allocation (the batcher preempts or waits on this)."""
