"""What the audit reads from a server, as pydantic models: a body of another shape is a clear error,
not a traceback.

Only the fields the audit uses are checked; any others are kept and ignored (servers add their own):

- ``GET /v1/models``: ``{"data": [{"id": "<non-empty string>", "max_model_len": <int >= 1,
  optional>, ...}, ...]}``;
- a streamed completion's chunk: a JSON object whose ``choices``, when present, is a list of
  objects, and whose ``usage``, when present, holds non-negative integer ``prompt_tokens`` and
  ``prompt_tokens_details.cached_tokens`` (either may be null or absent); a chunk with an ``error``
  object is the server's refusal mid-stream.

``parse`` raises ``AuditResponseError`` (an ``AuditHTTPError``) naming the request, the field's path
and the problem. Imported by ``client`` when it reads an answer, so ``import kvlab.audit`` needs no
pydantic.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from .errors import AuditHTTPError

__all__ = ["AuditResponseError", "ModelList", "StreamChunk", "Usage", "parse"]

# a token count: an int (not a bool, not "12"), never negative
Count = Annotated[int, Field(strict=True, ge=0)]


class AuditResponseError(AuditHTTPError):
    """The server answered, but not with the JSON shape an OpenAI-compatible server sends."""


class _Wire(BaseModel):
    """A JSON object from the server: the fields named here are checked, the others kept and
    ignored."""

    model_config = ConfigDict(extra="allow")


class ModelCard(_Wire):
    """One entry of ``GET /v1/models``."""

    id: Annotated[str, StringConstraints(strict=True, min_length=1)]
    # the context (vLLM, kvlab serve)
    max_model_len: Annotated[int, Field(strict=True, ge=1)] | None = None


class ModelList(_Wire):
    """The body of ``GET /v1/models``."""

    data: list[ModelCard]


class PromptTokensDetails(_Wire):
    """``usage.prompt_tokens_details``: the prompt tokens the server served from its cache."""

    cached_tokens: Count | None = None


class Usage(_Wire):
    """A completion's ``usage`` (only the prompt side is read)."""

    prompt_tokens: Count | None = None
    prompt_tokens_details: PromptTokensDetails | None = None


class StreamChunk(_Wire):
    """One ``data:`` event of a streamed completion."""

    choices: list[dict[str, Any]] | None = None
    usage: Usage | None = None
    error: dict[str, Any] | None = None  # kvlab serve and vLLM report a failure mid-stream this way


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], obj: Any, what: str) -> M:
    """``obj`` (decoded JSON) as ``model``; ``AuditResponseError`` naming ``what`` and the offending
    field if not."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "the body"
        got = repr(err.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."
        raise AuditResponseError(
            f"{what} answered JSON of the wrong shape: {where}: {err['msg']} (got {got}); "
            "is this an OpenAI-compatible server?"
        ) from None
