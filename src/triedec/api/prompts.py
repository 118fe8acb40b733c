"""Text to token ids and back, for one tokenizer: prompts (a string, chat messages through the chat
template, or token ids), a request's stop rule and context documents, and the text of a result.

The checks here are the ones that need the model's tokenizer and vocabulary; everything else was
checked where the :class:`~triedec.api.generation.GenerationRequest` was built.

**Special tokens in text.** By default a string is tokenized as transformers does: the text of a
special token (``<|im_end|>``) becomes that control token, also inside a chat message, so text a
user typed can close its turn and open a forged one. With ``split_special=True`` (what ``triedec
serve`` passes unless ``--special-tokens-in-text``) the text inside messages, and a text prompt,
is tokenized with special tokens split as plain text: only the chat template makes control tokens.
Token-id prompts are used as given either way.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from triedec.api.generation import GenerationRequest, Prompt, checked_prompt
from triedec.core.errors import TriedecError
from triedec.engine.request import StopRule

PIECE_CHARS = 4
"""A text of more than this many characters a token of a bound is counted in pieces against it
(:meth:`Prompts._ids_within`)."""


class PromptTooLong(TriedecError):
    """A prompt of more tokens than a bound (``most``), found without tokenizing all of a long one."""

    def __init__(self, message: str, most: int) -> None:
        super().__init__(message)
        self.most = most


class Prompts:
    """``tokenizer`` (a transformers tokenizer) for a model of ``vocab_size`` tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()

    def _ids(self, text: str, split_special: bool, **kwargs: Any) -> list[int]:
        """``text``'s token ids, one call at a time. transformers' fast tokenizers keep
        ``split_special_tokens`` as a setting of the shared Rust tokenizer, which each call sets:
        calls from several threads at once could tokenize with each other's setting (under load a
        server's chat prompt, encoded without splitting, got its special tokens split by a
        completion's call beside it, and the request another prompt)."""
        with self._lock:
            return list(self.tokenizer(text, split_special_tokens=split_special, **kwargs)["input_ids"])

    def _ids_within(self, text: str, split_special: bool, most: int | None, **kwargs: Any) -> list[int]:
        """:meth:`_ids`, refused (:class:`PromptTooLong`) once ``text`` is seen to make more than
        ``most`` tokens, before the whole of a long text is tokenized: a text longer than
        :data:`PIECE_CHARS` characters a token of ``most`` is counted piece by piece, each of that
        many characters ending before a space (where byte-level BPE's words start, so the pieces'
        counts add up to the whole's; another tokenizer may merge across a cut, allowed for with
        two tokens a piece), and refused as soon as the count passes; only a text found within is
        then tokenized whole. So a refusal tokenizes at most ~``PIECE_CHARS x (most + 1)``
        characters whatever the text's size."""
        piece = PIECE_CHARS * ((most or 0) + 1)
        if most is not None and len(text) > piece:
            counted, at, pieces = 0, 0, 0
            while at < len(text):
                end = min(len(text), at + piece)
                if end < len(text):
                    cut = text.rfind(" ", at + piece // 2, end)
                    end = cut if cut > at else end
                counted += len(self._ids(text[at:end], split_special, add_special_tokens=False))
                pieces += 1
                if counted > most + 2 * pieces:
                    raise PromptTooLong(f"the prompt is more than {most} tokens long (counted {counted} in its first "
                                        f"{end} characters)", most)
                at = end
        ids = self._ids(text, split_special, **kwargs)
        if most is not None and len(ids) > most:
            raise PromptTooLong(f"the prompt is {len(ids)} tokens long, more than {most}", most)
        return ids

    def tokenize(self, text: str, add_special_tokens: bool = True, most: int | None = None) -> list[int]:
        """``text``'s token ids as transformers tokenizes it (special tokens' text becomes the
        control token; ``add_special_tokens``: the tokenizer's own BOS/EOS, if it adds any);
        ``most``: refuse (:class:`PromptTooLong`) a text of more tokens, without tokenizing the
        whole of a long one (:meth:`_ids_within`)."""
        return self._ids_within(text, False, most, add_special_tokens=add_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: Prompt, chat: bool = False, split_special: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None, most: int | None = None) -> list[int]:
        """Token ids for a string (plain tokenization, or the chat template if ``chat``), a list
        of chat messages (the chat template), or a list of token ids (used as is);
        ``split_special``: special tokens' text in strings and messages stays plain text (module
        doc); ``tools``: functions the chat template shows the model (OpenAI's ``tools`` shape);
        ``most``: a prompt of more tokens is refused (:class:`PromptTooLong`), without tokenizing
        the whole of a long text (:meth:`_ids_within`)."""
        return self.tokens(checked_prompt(prompt), chat, split_special, tools, most)

    def tokens(self, prompt: Prompt, chat: bool = False, split_special: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None, most: int | None = None) -> list[int]:
        """:meth:`encode` for a prompt already checked for shape (a
        :class:`~triedec.api.generation.GenerationRequest`'s): only what needs the tokenizer and the
        vocabulary is checked here."""
        if isinstance(prompt, str):
            if chat:
                return self.tokens(({"role": "user", "content": prompt},), split_special=split_special, tools=tools,
                                   most=most)
            ids = self._ids_within(prompt, split_special, most)
        elif isinstance(prompt[0], Mapping):
            if not self.has_chat_template:
                raise TriedecError("this model's tokenizer has no chat template; pass a string or token ids")
            ids = self._chat_ids(list(prompt), split_special, tools, most)
        else:
            ids = list(prompt)
            if any(t >= self.vocab_size for t in ids):  # type: ignore[operator]
                raise TriedecError(f"token ids must lie in [0, {self.vocab_size})")
            if most is not None and len(ids) > most:
                raise PromptTooLong(f"the prompt is {len(ids)} tokens long, more than {most}", most)
        if not ids:
            raise TriedecError("the prompt is empty (no tokens)")
        return list(ids)

    @cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The text of every token the tokenizer matches as a unit before splitting (its added and
        special tokens)."""
        decoder = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        texts = {getattr(t, "content", str(t)) for t in decoder.values()}
        texts |= set(getattr(self.tokenizer, "all_special_tokens", ()) or ())
        return tuple(sorted(t for t in texts if t))

    def _chat_ids(self, messages: list[Mapping[str, Any]], split_special: bool,
                  tools: Sequence[Mapping[str, Any]] | None = None, most: int | None = None) -> list[int]:
        """The chat template's token ids for ``messages``. With ``split_special``, every string of
        the client's that holds a special token's text (a message's content or name, a tool call's
        name or arguments, any string of ``tools``: descriptions, parameter names and schemas) is
        found in the rendered template and tokenized on its own with special tokens split; the
        template's own text around it is tokenized as usual. Where it is: the template is rendered
        a second time with each such string replaced by a marker, and the template's own text
        between the markers is matched against the first rendering, each string in the form the
        template wrote it (as given, stripped, or as a JSON string's inside, as ``tojson`` writes
        it). Requests without such text (nearly all) are tokenized exactly as without
        ``split_special``."""
        text = self._render(messages, tools)
        if not split_special:
            return self._ids_within(text, False, most, add_special_tokens=False)
        marked: list[str] = []
        for value in _client_strings(messages, tools):
            if value not in marked and any(special in value for special in self.special_texts):
                marked.append(value)
        if not marked:
            return self._ids_within(text, False, most, add_special_tokens=False)
        self._ids_within(text, True, most, add_special_tokens=False)  # a bound on the count, before the pieces
        marker = {value: f"\ue000{i}\ue001" for i, value in enumerate(marked)}
        template = _MARKER.split(self._render(_replaced(messages, marker), _replaced(tools, marker)))
        pieces: list[tuple[str, bool]] = [(template[0], False)]  # (text, split its special tokens)
        at = len(template[0])
        if not text.startswith(template[0]):
            raise TriedecError(_CHANGED)
        for i in range(1, len(template), 2):
            value, after = marked[int(template[i])], template[i + 1]
            forms = dict.fromkeys((value, value.strip(), json.dumps(value, ensure_ascii=False)[1:-1]))
            form = next((f for f in forms if text.startswith(f, at) and text.startswith(after, at + len(f))), None)
            if form is None:
                raise TriedecError(_CHANGED)
            pieces += [(form, True), (after, False)]
            at += len(form) + len(after)
        if at != len(text):
            raise TriedecError(_CHANGED)
        ids: list[int] = []
        for piece, split in pieces:
            if piece:
                ids += self._ids(piece, split, add_special_tokens=False)
        return ids

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                  tokenize=False, add_generation_prompt=True)

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for (at least 1; one more than the
        longest token's own text, for a leading space a decoder drops): what bounds a text's
        token count from below without tokenizing it (:meth:`at_least_tokens`)."""
        vocab = self.tokenizer.get_vocab()
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        if decoder is not None:
            longest = max((len(decoder.decode([piece]).encode()) for piece in vocab), default=1)
        else:
            longest = max((len(piece.encode()) for piece in vocab), default=1)
        return max(1, longest) + 1

    def at_least_tokens(self, prompt: Prompt) -> int:
        """A lower bound on the tokens ``prompt`` makes, from its size alone (token ids: their
        count; text: its characters over :attr:`max_token_bytes`, since a character is at least one
        UTF-8 byte): a prompt surely too long for the context is refused before it is tokenized, at
        a cost that does not grow with it."""
        if isinstance(prompt, str):
            size = len(prompt)
        elif prompt and isinstance(prompt[0], Mapping):
            size = sum(len(m["content"]) for m in prompt if isinstance(m.get("content"), str))  # type: ignore[union-attr,index]
        else:
            return len(prompt)
        return math.ceil(size / self.max_token_bytes)

    def prepare(self, request: GenerationRequest, prompt_tokens: int, eos_token_ids: frozenset[int],
                max_context: int | None) -> tuple[StopRule, list[list[int]]]:
        """The checks that need the model (the context length ``max_context``, token ids against
        the vocabulary), then the request's stop rule (``eos_token_ids``, unless it ignores them,
        plus its own stop ids and strings) and its tokenized context documents."""
        if max_context is not None and prompt_tokens + request.max_new_tokens > max_context:
            raise TriedecError(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the "
                f"model's context of {max_context} tokens"
            )
        for t in request.stop_token_ids:
            if t >= self.vocab_size:
                raise TriedecError(f"stop token id {t!r} is not in [0, {self.vocab_size})")
        for t, _ in request.sampling.logit_bias:
            if t >= self.vocab_size:
                raise TriedecError(f"logit_bias token id {t!r} is not in [0, {self.vocab_size})")
        rule = StopRule(
            max_new_tokens=request.max_new_tokens,
            eos_token_ids=(frozenset() if request.ignore_eos else eos_token_ids) | set(request.stop_token_ids),
            stop_strings=request.stop,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            min_tokens=request.sampling.min_tokens,
        )
        documents = []
        for d in request.context:
            if isinstance(d, str):
                documents.append(self._ids(d, False, add_special_tokens=False))
            elif any(t >= self.vocab_size for t in d):
                raise TriedecError(f"each context document must be a string or a list of token ids in "
                                   f"[0, {self.vocab_size})")
            else:
                documents.append(list(d))
        return rule, documents

    def decode_result(self, tokens: Sequence[int], stop: str | Sequence[str] | None = None) -> str:
        """Text of ``tokens`` (special tokens skipped), cut right after the first stop string."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        ends = [text.find(s) + len(s) for s in stops if s in text]
        return text[: min(ends)] if ends else text


_MARKER = re.compile("\ue000(\\d+)\ue001")
_CHANGED = ("a message or tool holds a special token's text and the chat template changed that text, so it "
            "cannot be kept apart from the template's own tokens; remove the special token's text from it")


def _client_strings(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """Every string of the client's a chat template may write: each message's values (its content,
    name, tool calls' names and arguments), every string and key of ``tools``."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, Mapping):
            for key, inner in value.items():
                walk(key)
                walk(inner)
        elif isinstance(value, list | tuple):
            for inner in value:
                walk(inner)

    for message in messages:
        for key, value in message.items():
            if key != "role":
                walk(value)
    walk(list(tools or ()))
    return found


def _replaced(value: Any, marker: Mapping[str, str]) -> Any:
    """``value`` (messages or tools) with every string that ``marker`` names replaced by its marker."""
    if isinstance(value, str):
        return marker.get(value, value)
    if isinstance(value, Mapping):
        return {_replaced(k, marker): _replaced(v, marker) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_replaced(v, marker) for v in value]
    return value
