"""Request bodies of the OpenAI-compatible API (pydantic, strict) and OpenAI-style errors.

Fields are an allow-list: a body with a field not listed here is refused (400) instead of being
silently ignored, so a client never believes a setting took effect when it did not. Types are strict
(``"5"`` is not an int, ``true`` is not a number). Accepted beyond OpenAI's fields, as vLLM accepts
them: ``cache_salt``, ``top_k``, ``ignore_eos``, ``return_token_ids``. Fields OpenAI has that kvlab
does not implement (``n`` > 1, penalties, ``logprobs``) are accepted only at their neutral value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..chat import Message, TextPart

__all__ = [
    "PROMPT_BYTES_PER_TOKEN",
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "Message",
    "TextPart",
    "error_body",
    "validation_message",
]

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256
# The default prompt-text limit (ServeConfig.max_prompt_bytes, --max-prompt-bytes): this many UTF-8 bytes per
# token of the model's context. Text tokenizes at about 4 bytes a token; 32 leaves room for long tokens (runs
# of spaces, CJK) and still bounds the tokenizer's work to a fraction of a second (32 KiB for a 1,024-token
# model, 256 KiB for 8,192 tokens).
PROMPT_BYTES_PER_TOKEN = 32


class ApiError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        """OpenAI's error type: invalid_request_error (4xx) or server_error (5xx)."""
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        """The JSON body."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """A one-line message (with the field's path) and the offending top-level parameter, from a pydantic error."""
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"]]
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unsupported field (kvlab serve accepts only the fields it implements)"
    return (f"{'.'.join(loc)}: {msg}" if loc else msg), (loc[0] if loc else None)


class _Body(BaseModel):
    """Fields and checks shared by both endpoints."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None  # None = the served model (as vLLM)
    max_tokens: int | None = None
    temperature: float | None = None  # None = 1.0 (OpenAI's default)
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM extension, combined with the tenant by the engine (engine.tenants)
    ignore_eos: bool = False  # vLLM extension
    return_token_ids: bool = False  # vLLM extension: prompt_token_ids and token_ids in the response
    user: str | None = None  # accepted and ignored, as OpenAI's end-user id
    n: Literal[1] = 1
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logprobs: Literal[False] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None:
            if len(stops) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop strings")
            if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
                raise ValueError(f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string if given")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and (set(v) - {"include_usage"} or not isinstance(v.get("include_usage", False), bool)):
            raise ValueError("only {'include_usage': bool} is supported")
        return v

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Body):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] = Field(...)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("give one prompt per request (a list of several prompts is not supported)")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v


class ChatRequest(_Body):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[Message]) -> list[Message]:
        if not v:
            raise ValueError("messages must not be empty")
        return v
