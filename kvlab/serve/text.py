"""Generated tokens -> text, incrementally, with OpenAI's ``stop`` strings (the engine knows only stop tokens).

``TextStream.push(new_ids)`` returns the text that may be sent now. It decodes all ids so far (special
tokens dropped) and holds back what could still change or be cut:

- a trailing U+FFFD: an incomplete UTF-8 character whose next bytes are in a later token;
- the longest tail that is the start of a stop string (it may become the stop string).

When a stop string appears the text ends before it (``stopped`` is set; the server then aborts the
engine request, which frees its blocks). The text sent over a stream concatenates to exactly the text of
the non-streamed answer. Reference: vLLM's ``detokenizer`` (``IncrementalDetokenizer``, ``check_stop_strings``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream"]


class TextStream:
    """Detokenize one request's output as it grows and apply its stop strings."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # the decoded (and, once stopped, truncated) text
        self.sent = 0  # characters of text already returned by push
        self.stopped = False  # a stop string matched
        self.num_tokens_at_stop: int | None = None  # tokens generated when the stop string matched

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Add generated ids; return the new text that is safe to send (everything left when ``final``)."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.num_tokens_at_stop, text, final = True, len(self.ids), text[:cut], True
        self.text = text
        end = len(text) if final else len(text) - self._holdback(text)
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta

    def _holdback(self, text: str) -> int:
        """Characters at the end of ``text`` that must wait for the next token."""
        hold = 1 if text.endswith("\ufffd") else 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):  # longest tail that starts s
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold
