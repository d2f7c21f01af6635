"""Typed engine errors. Callers at process edges map these to gRPC status / OpenAI error JSON."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ConfigError(EngineError, ValueError):
    """A configuration value is invalid; the message lists the valid choices."""


class ModelLoadError(EngineError):
    """The model path is missing, unreadable, corrupt or of an unsupported kind."""


class InvalidRequestError(EngineError, ValueError):
    """A request is malformed: empty prompt, prompt too long, bad sampling values, duplicate id."""


class OutOfBlocksError(EngineError):
    """The KV block pool cannot satisfy an allocation (the batcher preempts or waits on this)."""
