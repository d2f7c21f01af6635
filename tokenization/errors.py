"""The error roots and the two errors both layers raise, defined once on the ground floor.

Both the engine and the services import this package, so a concept that both raise lives here as one
class: `ConfigError` (a setting is invalid) and `InvalidRequestError` (a caller's input is malformed).
Each belongs to both families, so `except EngineError` (the engine's root, `ModelError` here) at a
worker's edge and `except BatonError` (the services' root) at the HTTP edge both catch it, and the HTTP
edge renders it by its `http_status` and `code`.
"""


class BatonError(Exception):
    """Base of every error a Baton service raises on purpose (services.common.errors holds the rest)."""

    http_status: int = 500
    code: str = "internal_error"


class ModelError(Exception):
    """Base class of every error raised on purpose about a model or a request made of it."""


class ModelLoadError(ModelError):
    """The model path is missing, unreadable, corrupt or of an unsupported kind."""


class ConfigError(BatonError, ModelError, ValueError):
    """A setting or configuration value is missing or invalid; the message names it and the valid choices."""

    code = "config_error"


class InvalidRequestError(BatonError, ModelError, ValueError):
    """A caller's input is malformed: empty prompt, prompt too long, bad sampling values, duplicate id,
    messages the chat template rejects, a bad date range, an unknown group_by or tier.

    `param` names the offending request field where the raiser knows it (the HTTP edge reports it)."""

    http_status = 400
    code = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
