"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`: every error of the API is one."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvpop.openai_api.engine_client import EngineError

# kvpop.serving.errors kind -> (HTTP status, OpenAI error type)
ERROR_STATUS = {
    "invalid": (400, "invalid_request_error"),
    "overloaded": (503, "service_unavailable"),
    "internal": (500, "server_error"),
}


class APIError(Exception):
    def __init__(self, status: int, message: str, error_type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.error_type, self.param, self.code = status, error_type, param, code

    def body(self) -> dict:
        # A message quoting what a client sent may hold a lone surrogate, which no response can encode.
        message, param = (None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")
                          for text in (str(self), self.param))
        return {"error": {"message": message, "type": self.error_type, "param": param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    @classmethod
    def from_engine(cls, error: EngineError) -> "APIError":
        status, error_type = ERROR_STATUS[error.kind]
        return cls(status, str(error), error_type)

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> "APIError":
        """A client mistake: 400 invalid_request_error."""
        return cls(400, message, "invalid_request_error", param, code)
