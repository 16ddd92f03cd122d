"""Request bodies of the OpenAI-compatible API (pydantic, strict) and OpenAI-style errors.

Fields are an allow-list: a body with a field not listed here is refused (400 naming it) instead of
being silently ignored, so a client never believes a setting took effect when it did not. Types are
strict (``"5"`` is not an int, ``true`` is not a number). ``null`` for a nullable field means its
default. Beyond OpenAI's fields, vLLM's sampling extensions are implemented with vLLM's meaning
(``vllm/sampling_params.py``): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``ignore_eos``,
``prompt_logprobs`` (completions), ``cache_salt`` and ``return_token_ids``. The README lists what is
implemented and what is refused.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..chat import Message, TextPart

__all__ = [
    "MAX_CHOICES",
    "MAX_LOGPROBS",
    "MAX_N",
    "PROMPT_BYTES_PER_TOKEN",
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "Message",
    "TextPart",
    "TokenizeRequest",
    "error_body",
    "validation_message",
]

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256
MAX_N = 16  # choices per prompt (n)
MAX_CHOICES = 64  # choices per request: prompts x n
MAX_LOGPROBS = 20  # logprobs / top_logprobs / prompt_logprobs (vLLM's default max_logprobs)
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
# The default prompt-text limit (ServeConfig.max_prompt_bytes, --max-prompt-bytes): this many UTF-8
# bytes per token of the model's context. Text tokenizes at about 4 bytes a token; 32 leaves room
# for long tokens (runs of spaces, CJK) and still bounds the tokenizer's work to a fraction of a
# second (32 KiB for a 1,024-token model, 256 KiB for 8,192 tokens).
PROMPT_BYTES_PER_TOKEN = 32


class ApiError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with a
    status."""

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
    """A one-line message (with the field's path) and the offending top-level parameter, from a
    pydantic error."""
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"]]
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unsupported field (kvlab serve accepts only the fields it implements)"
    # a check across fields names its field
    if not loc and ": " in msg and msg.split(": ", 1)[0].isidentifier():
        return msg, msg.split(": ", 1)[0]
    return (f"{'.'.join(loc)}: {msg}" if loc else msg), (loc[0] if loc else None)


def _in_range(v: int | None, lo: int, hi: int) -> int | None:
    """``v`` if None or in ``[lo, hi]``, else a ``ValueError`` that states the range."""
    if v is not None and not lo <= v <= hi:
        raise ValueError(f"must be in [{lo}, {hi}], got {v}")
    return v


class _Body(BaseModel):
    """Fields and checks shared by both endpoints (``None`` = the field's default)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None  # None = the served model (as vLLM)
    max_tokens: int | None = None
    temperature: float | None = None  # None = 1.0 (OpenAI's default)
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; 0 or -1 = off
    min_p: float | None = None  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    include_stop_str_in_output: bool | None = None  # vLLM extension
    skip_special_tokens: bool | None = None  # vLLM extension (default true)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    # vLLM extension, combined with the tenant by the engine (engine.tenants)
    cache_salt: str | None = None
    ignore_eos: bool | None = None  # vLLM extension
    min_tokens: int | None = None  # vLLM extension
    # vLLM extension: prompt_token_ids and token_ids in the response
    return_token_ids: bool | None = None
    # OpenAI's end-user id: an opaque label, as OpenAI uses it (no effect on the answer)
    user: str | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None:
            if len(stops) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop strings")
            if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
                raise ValueError(
                    f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters"
                )
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string if given")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and (
            set(v) - {"include_usage"} or not isinstance(v.get("include_usage", False), bool)
        ):
            raise ValueError("only {'include_usage': bool} is supported")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        return _in_range(v, 1, MAX_N)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[int, float] | None:
        if not v:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        out = {}
        for key, bias in v.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
            out[int(key)] = float(bias)
        return out

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Body):
    """``POST /v1/completions``: one prompt or a list of prompts, each as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(...)
    echo: bool | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM extension
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> None:
        if v:
            raise ValueError(
                "not supported by kvlab serve (no insertion: the models it serves are not trained "
                "for it)"
            )
        return None

    @field_validator("prompt")
    @classmethod
    def _prompt(
        cls, v: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if not v:
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and isinstance(v[0], (str, list)):
            if len(v) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts per request")
            if any(not p for p in v):
                raise ValueError("a prompt of the list is empty")
        return v

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        return _in_range(v, 0, MAX_LOGPROBS)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group (a lone prompt is a list of one)."""
        v = self.prompt
        if isinstance(v, list) and isinstance(v[0], (str, list)):
            return list(v)
        return [v]

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError(
                "best_of: only best_of = n is supported (kvlab returns every sequence it samples)"
            )
        if len(self.prompts) * (self.n or 1) > MAX_CHOICES:
            raise ValueError(f"n: prompts x n must be at most {MAX_CHOICES}")
        return self


class ChatRequest(_Body):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[Message]) -> list[Message]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        return _in_range(v, 0, MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages`` rendered with the chat
    template."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    # default: true for a prompt, false for messages (vLLM's)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # messages only; default true
    return_token_strs: bool | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must not be empty")
        if self.prompt is not None and self.add_generation_prompt is not None:
            raise ValueError("add_generation_prompt: only with messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]
