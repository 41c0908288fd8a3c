"""Typed errors of the API, shared by the HTTP routes and the Python handle API.

Each error knows its HTTP status and renders as an OpenAI error object
``{"error": {"message", "type", "param", "code"}}``. They pickle with their fields, so a Python caller of
the ingress handle can catch them by type (Ray re-raises a replica exception as a subclass of it).
"""

from __future__ import annotations

from typing import Any, Optional


class APIError(Exception):
    """Base of the API errors: an HTTP status plus the fields of an OpenAI error object."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self):
        # Exceptions pickle as (cls, self.args); keep the named fields across Ray instead.
        return (type(self), (self.message, self.param, self.code))

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        return {}


class BadRequestError(APIError):
    """Invalid input: bad JSON, a missing or out-of-range field, a prompt the model cannot hold."""

    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(APIError):
    """Missing or wrong API key."""

    status_code = 401
    error_type = "invalid_request_error"


class ModelNotFoundError(APIError):
    """The request names a model this application does not serve."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: Optional[str] = "model", code: Optional[str] = "model_not_found"):
        super().__init__(message, param, code)


class NotFoundError(APIError):
    """Unknown route."""

    status_code = 404
    error_type = "invalid_request_error"


class RequestTooLargeError(APIError):
    """The request body is over the configured limit."""

    status_code = 413
    error_type = "invalid_request_error"


class EngineError(APIError):
    """The engine failed while serving the request (model forward error, replica death)."""

    status_code = 500
    error_type = "internal_error"


class ReplicaUnavailableError(EngineError):
    """The engine replica died, or the one admission chose is gone; before any output the request is
    admitted again and sent elsewhere, after it this is the request's error."""


class ServiceUnavailableError(APIError):
    """No engine replica can take the request now; retry after `retry_after_s` seconds."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = "service_unavailable",
        retry_after_s: float = 1.0,
    ) -> None:
        super().__init__(message, param, code)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (type(self), (self.message, self.param, self.code, self.retry_after_s))

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after_s)))}


class TooManyRequestsError(ServiceUnavailableError):
    """Admission rejected the request (queue full or timed out) with `reject_status: 429`; a
    ServiceUnavailableError too, so a handle caller catches both kinds of "retry later" at once."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = "rate_limit_exceeded",
                 retry_after_s: float = 1.0) -> None:
        super().__init__(message, param, code, retry_after_s)


def error_body(message: str, error_type: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def unwrap(exc: BaseException) -> BaseException:
    """The original exception of a Ray-wrapped one (RayTaskError keeps it as `.cause`)."""
    seen = 0
    while getattr(exc, "cause", None) is not None and seen < 8:
        cause = exc.cause  # type: ignore[attr-defined]
        if not isinstance(cause, BaseException):
            break
        exc, seen = cause, seen + 1
    return exc
