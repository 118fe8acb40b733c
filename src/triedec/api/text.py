"""Committed tokens to text, incrementally: what a stream shows as tokens arrive.

:class:`TextStream` decodes only a small window of recent tokens per call (vLLM's incremental
detokenization: the text of ``tokens[prefix:]`` minus that of ``tokens[prefix:read]``), so a long
answer costs O(tokens) in all, not O(tokens^2). It holds back an incomplete UTF-8 character and,
with stop strings, any tail that could still grow into one. The server (OpenAI's semantics: the
stop string is not returned) and the CLI (the library's: text ends right after it) share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    """Turns committed tokens into text deltas. ``stops``: stop strings; the text ends right
    before the first one (``keep_stop=False``, OpenAI's semantics) or right after it (``True``).
    :meth:`finish` decodes every token once more, so the final text is exactly
    ``tokenizer.decode(tokens)`` (cut at a stop string) whatever the tokenizer."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), keep_stop: bool = False) -> None:
        self.tokenizer, self.stops, self.keep_stop = tokenizer, tuple(stops), keep_stop
        self.tokens: list[int] = []
        self.sent = ""  # text handed out so far
        self._text = ""  # text of tokens[:read] (read = where the window's new part starts)
        self._prefix = 0  # the window's start: decoded again for context
        self._read = 0
        self._stopped = False

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _cut(self, text: str) -> tuple[str, bool]:
        """``text`` cut at the first stop string, and whether one was found."""
        found = [text.find(s) + (len(s) if self.keep_stop else 0) for s in self.stops if s in text]
        return (text[: min(found)], True) if found else (text, False)

    def add(self, new: Sequence[int]) -> str:
        """Append ``new`` tokens; the text that can be shown now (possibly empty)."""
        self.tokens += new
        if self._stopped:
            return ""
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
        text, self._stopped = self._cut(self._text)
        if not self._stopped:
            hold = max((k for s in self.stops for k in range(len(s), 0, -1) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - hold]
        return self._delta(text)

    def finish(self) -> str:
        """The rest of the text, once the last token has arrived."""
        return self._delta(self.text)

    @property
    def text(self) -> str:
        """The whole text so far, decoded at once and cut at a stop string."""
        return self._cut(self._decode(self.tokens))[0]

    def _delta(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
