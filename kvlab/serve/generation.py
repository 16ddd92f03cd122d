"""One request's life on the event loop: its engine updates -> text pieces, usage, metrics, and its
end.

``Generation.pieces()`` turns the updates the engine thread sends (``kvlab.serve.runner.Update``)
into ``Piece``s of text and token ids. ``close()`` runs exactly once however the request ends
(finished, stop string, client gone, error): it aborts the engine request if it is still running,
which frees its blocks, and counts the request in the metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request

from .metrics import ServeMetrics
from .protocol import ApiError
from .runner import EngineRunner, Job, now
from .text import TextStream

__all__ = ["ClientGone", "Generation", "OutputText", "Piece", "wait_or_disconnect"]


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


@dataclass(slots=True)
class Piece:
    """Text and token ids that may be sent now; ``finish_reason`` is set on the last piece."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # one kvlab.engine.logprobs.TokenLogprob per token id, when the request asked for logprobs
    logprobs: list | None = None


class OutputText(TextStream):
    """``TextStream`` with vLLM's ``skip_special_tokens`` and ``include_stop_str_in_output``."""

    def __init__(
        self, tokenizer, stop=(), skip_special_tokens: bool = True, include_stop: bool = False
    ) -> None:
        super().__init__(tokenizer, stop)
        self.skip_special_tokens, self.include_stop = skip_special_tokens, include_stop

    def _decode(self, ids: list[int]) -> str:
        self.num_decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _find_stop(self, checked: int) -> int:
        """Where the text ends at a stop string: before it, or after it with ``include_stop``."""
        cut = super()._find_stop(checked)
        if cut < 0 or not self.include_stop:
            return cut
        text = self.text
        return cut + max(len(s) for s in self.stop if text.startswith(s, cut))


class Generation:
    """Consumes one job's updates; knows its usage numbers; ends it once."""

    def __init__(self, runner: EngineRunner, metrics: ServeMetrics, job: Job, stream: TextStream,
                 arrival: float, want_ids: bool = False) -> None:
        self.runner, self.metrics, self.job, self.text = runner, metrics, job, stream
        self.want_ids = want_ids  # vLLM's return_token_ids: answers carry token ids
        # vLLM's include_stop_str_in_output also keeps the text of the stop token (or eos) that
        # ended the answer
        self.text_has_stop_token = bool(getattr(stream, "include_stop", False))
        self.arrival = arrival
        self.num_cached_tokens = 0
        self.num_generated = 0  # tokens the engine produced for this request
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._pending: list = []  # updates taken by first() and not yet turned into pieces
        self.finish_reason: str | None = None
        self.logprobs: list = []  # records of the tokens answered so far (when asked)
        # the prompt's records (when asked), with the first tokens
        self.prompt_logprobs: list | None = None
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.job.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        """Tokens the answer reports: up to the one that completed a stop string, if one matched."""
        at_stop = self.text.num_tokens_at_stop
        return self.num_generated if at_stop is None else at_stop

    def usage(self) -> dict:
        """OpenAI's usage object, with ``prompt_tokens_details.cached_tokens``."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    async def first(self) -> None:
        """Wait for the first update: raise ``ApiError`` (400) if the engine refused the request."""
        update = await self.job.queue.get()
        if update.refused:
            self._closed = True  # nothing reached the engine
            raise ApiError(
                400, update.error or "request refused", param=update.field, code="invalid_request"
            )
        self._pending.append(update)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The answer piece by piece; the last has ``finish_reason``. An engine error raises
        ``ApiError`` (500)."""
        while self.finish_reason is None:
            update = self._pending.pop(0) if self._pending else await self.job.queue.get()
            t = now()
            if update.num_cached_tokens is not None:
                self.num_cached_tokens = update.num_cached_tokens
            if update.token_ids:
                if self.first_token_at is None:
                    self.first_token_at = t
                    self.metrics.ttft.observe(t - self.arrival)
                else:
                    self.metrics.itl.observe(t - self._last_token_at)
                self._last_token_at = t
            self.num_generated += len(update.token_ids)
            if update.prompt_logprobs is not None:
                self.prompt_logprobs = update.prompt_logprobs
            if update.finished and update.finish_reason == "error":
                self.finish_reason = "error"
                raise ApiError(
                    500, f"the request failed in the engine: {update.error}", code="engine_error"
                )
            if update.finished and update.finish_reason == "abort":
                self.finish_reason = "abort"
                raise ApiError(503, update.error or "the request was aborted", code="aborted",
                               headers={"Retry-After": "1"})
            text_ids = update.token_ids
            if (
                update.finished
                and update.finish_reason == "stop"
                and text_ids
                and not self.text_has_stop_token
            ):
                # vLLM's detokenizer: the eos or stop token that ended the answer is not in its text
                text_ids = text_ids[:-1]
            delta = self.text.push(text_ids, final=update.finished)
            ids = list(update.token_ids)
            if self.text.stopped:
                ids = ids[: max(0, self.text.num_tokens_at_stop - (self.num_generated - len(ids)))]
                self.finish_reason = "stop"
            elif update.finished:
                self.finish_reason = update.finish_reason
            lps = None if update.logprobs is None else list(update.logprobs[: len(ids)])
            if lps is not None:
                self.logprobs += lps
            yield Piece(delta, ids, self.finish_reason, lps)

    async def collect(self) -> tuple[str, list[int], str]:
        """The whole answer: text, token ids, finish reason (its log-probabilities:
        ``self.logprobs``)."""
        ids: list[int] = []
        reason = None
        async for piece in self.pieces():
            ids += piece.token_ids
            reason = piece.finish_reason
        return self.text.text, ids, reason or "stop"

    def close(self) -> None:
        """End the request once: abort it in the engine if still running (frees its blocks); count
        it."""
        if self._closed:
            return
        self._closed = True
        if not self.job.done:
            self.runner.abort(self.job.request_id)
        self.metrics.on_finish(self.prompt_tokens, self.completion_tokens, self.num_cached_tokens,
                               self.finish_reason or "abort", now() - self.arrival,
                               admitted=self.first_token_at is not None)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait_or_disconnect(request: Request, coro) -> object:
    """Await ``coro`` unless the client disconnects first (then cancel it and raise
    ``ClientGone``)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone()
