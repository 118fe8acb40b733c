"""Committed tokens to text, incrementally: what a stream shows as tokens arrive.

:class:`TextStream` decodes only a small window of recent tokens per call (vLLM's incremental
detokenization: the text of ``tokens[prefix:]`` minus that of ``tokens[prefix:read]``), so a long
answer costs O(tokens) in all, not O(tokens^2). It holds back an incomplete UTF-8 character and,
with stop strings, any tail that could still grow into one. The server (OpenAI's semantics: the
stop string is not returned) and the CLI (the library's: text ends right after it) share it.
"""

from __future__ import annotations

import weakref
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


def token_text(tokenizer: Any, token: int) -> str:
    """One token's own text (special tokens spelled out); an incomplete UTF-8 character shows as
    U+FFFD, as the tokenizer decodes it."""
    return tokenizer.decode([token], skip_special_tokens=False)


def token_label(tokenizer: Any, token: int) -> str:
    """How a response names one token: its :func:`token_text`, or, when that text hides bytes of
    an incomplete character, OpenAI's ``bytes:\\xNN...`` spelling of its bytes (so tokens that
    decode alike keep names of their own)."""
    return token_name(tokenizer, token)[0]


def token_bytes(tokenizer: Any, token: int) -> list[int]:
    """One token's UTF-8 bytes, also when they are part of a character (OpenAI's ``bytes``): the
    byte-level BPE alphabet (GPT-2's, as transformers defines it) or a ``<0xNN>`` byte-fallback piece
    read back to its bytes; otherwise the bytes of :func:`token_text`."""
    return token_name(tokenizer, token)[1]


def token_name(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    """:func:`token_label` and :func:`token_bytes` of one token, decoding it once (remembered per
    tokenizer: at most one entry per vocabulary id)."""
    try:
        names = _NAMES[tokenizer]
    except TypeError:  # a tokenizer that cannot be weakly referenced: no memory
        return _token_name(tokenizer, token)
    except KeyError:
        names = _NAMES.setdefault(tokenizer, {})
    found = names.get(token)
    if found is None:
        found = names[token] = _token_name(tokenizer, token)
    return found[0], list(found[1])


_NAMES: weakref.WeakKeyDictionary[Any, dict[int, tuple[str, tuple[int, ...]]]] = weakref.WeakKeyDictionary()
"""each tokenizer's token names so far (what every logprobs entry needs: a response's top
alternatives repeat the same few tokens)"""


def _token_name(tokenizer: Any, token: int) -> tuple[str, tuple[int, ...]]:
    text = token_text(tokenizer, token)
    if "\ufffd" not in text:
        return text, tuple(text.encode("utf-8"))
    raw = _piece_bytes(tokenizer, token)
    if raw is None or bytes(raw) == text.encode("utf-8"):
        return text, tuple(text.encode("utf-8"))
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), tuple(raw)


def _piece_bytes(tokenizer: Any, token: int) -> list[int] | None:
    """The bytes a token's vocabulary piece stands for (a ``<0xNN>`` byte-fallback piece or the
    byte-level BPE alphabet), or None when the piece is neither."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(piece, str):
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return [int(piece[3:5], 16)]
        except ValueError:
            pass
    table = _BYTE_DECODER
    if piece and all(c in table for c in piece):
        return [table[c] for c in piece]
    return None


class TokenOffsets:
    """Where each token's text starts in the text of every token given so far: the length of the
    complete characters the tokens before it decode to (a token that completes a character another
    began starts after that character). Incremental: O(tokens) in all."""

    def __init__(self, tokenizer: Any) -> None:
        self._text = TextStream(tokenizer)

    def add(self, tokens: Sequence[int]) -> list[int]:
        """The offsets of ``tokens``, which follow every token added before."""
        offsets = []
        for token in tokens:
            offsets.append(len(self._text.sent))
            self._text.add([token])
        return offsets


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet read back, character -> byte: GPT-2's table (printable bytes
    stand for themselves, the other 68 for code points 256 and up, in byte order), which every
    byte-level BPE tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_DECODER = _byte_decoder()
