"""The errors the ground floor raises on purpose; the engine's errors (`engine.errors`) extend this family.

`ModelError` is the root the engine calls `EngineError`, so an `except EngineError` at a process edge
also catches a tokenizer that cannot load or a chat template that rejects the messages.
"""


class ModelError(Exception):
    """Base class of every error raised on purpose about a model or a request made of it."""


class ModelLoadError(ModelError):
    """The model path is missing, unreadable, corrupt or of an unsupported kind."""


class InvalidRequestError(ModelError, ValueError):
    """A request is malformed: empty prompt, prompt too long, bad sampling values, duplicate id."""
