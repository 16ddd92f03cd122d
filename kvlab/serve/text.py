"""Generated tokens -> text, incrementally, with OpenAI's ``stop`` strings (the engine knows only
stop tokens).

``TextStream.push(new_ids)`` returns the text that may be sent now. The text is what decoding all
ids so far (special tokens dropped) gives, but each push decodes only a short window of recent ids,
so a long answer costs linear, not quadratic, work. It holds back what could still change or be cut:

- trailing U+FFFDs: an incomplete UTF-8 character whose next bytes are in a later token;
- the longest tail before them that is the start of a stop string (it may become the stop string,
  once the incomplete character is complete too).

When a stop string appears the text ends before it (``stopped`` is set; the server then aborts the
engine request, which frees its blocks). The text sent over a stream concatenates to exactly the
text of the non-streamed answer.

The window: ids ``[0, read)`` are settled, their text ``settled`` never changes. A push decodes ids
from ``prefix`` (the start of the previous settled step, a few tokens before ``read``) once up to
``read`` and once to the end; the second text minus the first is the text of the new ids. Decoding
from a few tokens back rather than from ``read`` keeps what a token's text depends on before it (a
SentencePiece tokenizer drops the leading space of the first token it decodes; a byte-level one may
start inside a character): both texts start the same way, so the difference is exact. The new text
settles (``read`` moves to the end) unless it ends in U+FFFD, whose bytes may still be completed.
Should a tokenizer ever decode the window so that the longer text does not start with the shorter,
the stream falls back to decoding every id on each push (the old way). ``tokenizers``'
``DecodeStream`` does the same for a fast tokenizer's backend; this works with any ``decode``.
References: vLLM's ``detokenize_incrementally`` and ``check_stop_strings``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream"]

_INCOMPLETE = "\ufffd"  # what decode shows for bytes of a character not yet complete


class TextStream:
    """Detokenize one request's output as it grows and apply its stop strings."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.sent = 0  # characters of text already returned by push
        self.stopped = False  # a stop string matched
        self.num_tokens_at_stop: int | None = None  # tokens generated when the stop string matched
        # ids passed to the tokenizer's decode, all pushes together (the cost)
        self.num_decoded_ids = 0
        self._settled = ""  # text of ids[:_read]: final
        self._pending = ""  # text of ids[_read:]: may change while it ends in U+FFFD
        self._prefix = self._read = 0  # decode window start; first id whose text is not settled
        self._prefix_text = ""  # text of ids[_prefix:_read] decoded alone
        # False after the window once disagreed: every push decodes all ids
        self._incremental = True

    @property
    def text(self) -> str:
        """The decoded text so far (and, once stopped, truncated before the stop string)."""
        return self._settled + self._pending

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Add generated ids; return the new text that is safe to send (everything left when
        ``final``)."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        # settled text was searched for stop strings by an earlier push
        checked = len(self._settled)
        self._pending = self._decode_new()
        # 0 once the stream fell back to decoding all
        cut = self._find_stop(min(checked, len(self._settled)))
        if cut >= 0:
            text = self.text[:cut]
            self._settled, self._pending = text, ""
            self.stopped, self.num_tokens_at_stop, final = True, len(self.ids), True
        elif self._incremental and self._pending and not self._pending.endswith(_INCOMPLETE):
            # ids that decode to nothing (special tokens) stay in the window: they give the next id
            # no context
            self._settle()
        total = len(self._settled) + len(self._pending)
        end = total if final else total - self._holdback()
        if end <= self.sent:
            return ""
        delta, self.sent = self._slice(self.sent, end), end
        return delta

    def _decode(self, ids: list[int]) -> str:
        self.num_decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_new(self) -> str:
        """The text of ids[_read:], decoded in the window from ``_prefix``."""
        window = self._decode(self.ids[self._prefix:])
        if window.startswith(self._prefix_text):
            return window[len(self._prefix_text):]
        # the tokenizer's text of the window is not context-free enough: from now on decode
        # everything
        self._incremental = False
        self._settled, self._prefix_text, self._prefix, self._read = "", "", 0, 0
        return self._decode(self.ids)

    def _settle(self) -> None:
        """The pending text is final: move ``_read`` to the end, and the window's start to the old
        ``_read``."""
        self._settled += self._pending
        self._pending = ""
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix:self._read])

    def _slice(self, start: int, end: int) -> str:
        """``self.text[start:end]`` without joining the whole text when ``start`` is in the pending
        part."""
        split = len(self._settled)
        if start >= split:
            return self._pending[start - split:end - split]
        return self._settled[start:end] + self._pending[:max(0, end - split)]

    def _tail(self) -> tuple[int, str]:
        """(where it starts, the end of the text) long enough for every stop-string and hold-back
        check."""
        start = max(0, len(self._settled) - self._longest_stop)
        return start, self._settled[start:] + self._pending

    def _find_stop(self, checked: int) -> int:
        """Where the earliest stop string starts in the text, -1 if none (only what ends past
        ``checked`` is new)."""
        if not self.stop:
            return -1
        base, tail = self._tail()
        found = [base + i for s in self.stop
                 if (i := tail.find(s, max(0, checked - len(s) + 1 - base))) >= 0]
        return min(found, default=-1)

    def _holdback(self) -> int:
        """Characters at the end of the text that must wait for the next token."""
        _, text = self._tail()
        # every trailing U+FFFD may still become a character; the text before them may start a stop
        # string that character completes ("## " then the first bytes of 实 under the stop "# 实":
        # hold "# " and the U+FFFD)
        complete = text.rstrip(_INCOMPLETE)
        incomplete = len(text) - len(complete)
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(complete)), 0, -1):  # longest tail that starts s
                if complete.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return incomplete + hold
