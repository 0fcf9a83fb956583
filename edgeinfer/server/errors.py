"""One error type for every handler; app.py renders it in the calling API's own shape:
OpenAI `{"error": {"message", "type", "param", "code"}}`, Ollama `{"error": "..."}`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    @property
    def openai_type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 404:
            return "not_found_error"
        if self.status == 429:
            return "rate_limit_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.openai_type,
                          "param": self.param, "code": self.code}}

    def ollama_body(self) -> dict:
        return {"error": self.message}


def bad_param(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_parameter")


def not_found(model: str, message: str | None = None) -> APIError:
    return APIError(404, message or f"model {model!r} not found", param="model",
                    code="model_not_found")
