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

import math
import threading
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from triedec.api.generation import GenerationRequest, Prompt, checked_prompt
from triedec.core.errors import TriedecError
from triedec.engine.request import StopRule


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

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids as transformers tokenizes it (special tokens' text becomes the
        control token; ``add_special_tokens``: the tokenizer's own BOS/EOS, if it adds any)."""
        return self._ids(text, False, add_special_tokens=add_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: Prompt, chat: bool = False, split_special: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids for a string (plain tokenization, or the chat template if ``chat``), a list
        of chat messages (the chat template), or a list of token ids (used as is);
        ``split_special``: special tokens' text in strings and messages stays plain text (module
        doc); ``tools``: functions the chat template shows the model (OpenAI's ``tools`` shape)."""
        return self.tokens(checked_prompt(prompt), chat, split_special, tools)

    def tokens(self, prompt: Prompt, chat: bool = False, split_special: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """:meth:`encode` for a prompt already checked for shape (a
        :class:`~triedec.api.generation.GenerationRequest`'s): only what needs the tokenizer and the
        vocabulary is checked here."""
        if isinstance(prompt, str):
            if chat:
                return self.tokens(({"role": "user", "content": prompt},), split_special=split_special, tools=tools)
            ids = self._ids(prompt, split_special)
        elif isinstance(prompt[0], Mapping):
            if not self.has_chat_template:
                raise TriedecError("this model's tokenizer has no chat template; pass a string or token ids")
            ids = self._chat_ids(list(prompt), split_special, tools)
        else:
            ids = list(prompt)
            if any(t >= self.vocab_size for t in ids):  # type: ignore[operator]
                raise TriedecError(f"token ids must lie in [0, {self.vocab_size})")
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
                  tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The chat template's token ids for ``messages``. With ``split_special``, each message whose
        text holds a special token's text is found in the rendered template and tokenized on its own
        with special tokens split; the template's own text around it is tokenized as usual. Messages
        without such text (nearly all) leave the tokenization exactly as without ``split_special``."""
        text = self.tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                                  add_generation_prompt=True)
        contents = [m.get("content") for m in messages]
        marked = [c for c in contents if isinstance(c, str) and any(s in c for s in self.special_texts)]
        if not split_special or not marked:
            return self._ids(text, False, add_special_tokens=False)
        pieces: list[tuple[str, bool]] = []  # (text, split its special tokens)
        at = 0
        for content in marked:
            for candidate in (content, content.strip()):
                found = text.find(candidate, at) if candidate else -1
                if found >= 0:
                    break
            else:
                raise TriedecError("a message holds a special token's text and the chat template changed that "
                                   "message's text, so it cannot be kept apart from the template's own tokens; "
                                   "remove the special token's text from the message")
            pieces += [(text[at:found], False), (candidate, True)]
            at = found + len(candidate)
        pieces.append((text[at:], False))
        ids: list[int] = []
        for piece, split in pieces:
            if piece:
                ids += self._ids(piece, split, add_special_tokens=False)
        return ids

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
