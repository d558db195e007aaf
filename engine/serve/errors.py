"""OpenAI-style errors: one exception type carrying the HTTP status and the error body's fields.

Every error the server returns has the body OpenAI's API returns:
    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}
"""
from __future__ import annotations

from starlette.responses import JSONResponse


class APIError(Exception):
    """An error answered with `status` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist; this server serves `{served}` (see GET /v1/models).",
                    "invalid_request_error", "model", "model_not_found")


def over_capacity(retry_after: int) -> APIError:
    return APIError(429, "The server is at capacity (every batch row and queue place is taken); "
                         f"retry after {retry_after} s.", "rate_limit_error", None, "over_capacity",
                    headers={"Retry-After": str(retry_after)})


def queue_timeout(waited_s: float, retry_after: int) -> APIError:
    return APIError(503, f"The request waited {waited_s:g} s in the queue without getting a batch row (the server "
                         f"is busy); retry after {retry_after} s.", "server_error", None, "queue_timeout",
                    headers={"Retry-After": str(retry_after)})


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


def shutting_down(retry_after: int = 1) -> APIError:
    return APIError(503, f"The server is shutting down; retry after {retry_after} s (or on another server).",
                    "server_error", None, "shutting_down", headers={"Retry-After": str(retry_after)})


def failure_error(failure) -> APIError:
    """The error a scheduler Failure (engine.serve.scheduler) is answered with: 503 shutting_down, or 500."""
    return shutting_down() if failure.status == 503 else server_error(failure.message)
