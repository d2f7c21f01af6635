"""Typed engine errors. Callers at process edges map these to gRPC status / OpenAI error JSON.

The root and the errors the tokenizer and the services raise too (`ConfigError`, `InvalidRequestError`,
`ModelLoadError`) are defined once in the torch-free ground floor (`tokenization.errors`); the engine
knows the root as `EngineError`.
"""

from tokenization.errors import ConfigError, InvalidRequestError, ModelLoadError
from tokenization.errors import ModelError as EngineError

__all__ = ["ConfigError", "EngineError", "InvalidRequestError", "ModelLoadError", "OutOfBlocksError"]


class OutOfBlocksError(EngineError):
    """The KV block pool cannot satisfy an allocation (the batcher preempts or waits on this)."""
