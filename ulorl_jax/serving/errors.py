"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, raised as one exception type.

Every bad request becomes an `APIError` with the HTTP status OpenAI (and vLLM) answer with: 400 for a bad
field (named in `param`), 401 for a missing or wrong API key, 404 for an unknown model. The app turns it
into a JSON response; nothing a client sends can reach a 500.
"""

from __future__ import annotations

from typing import Any

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


class APIError(Exception):
    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.code = code or {400: "invalid_value", 401: "invalid_api_key", 404: "model_not_found"}.get(status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}
