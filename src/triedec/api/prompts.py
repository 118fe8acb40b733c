"""Text to token ids and back, for one tokenizer: prompts (a string, chat messages through the chat
template, or token ids), a request's stop rule and context documents, and the text of a result.

The checks here are the ones that need the model's tokenizer and vocabulary; everything else was
checked where the :class:`~triedec.api.generation.GenerationRequest` was built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from triedec.api.generation import GenerationRequest, Prompt, checked_prompt
from triedec.core.errors import TriedecError
from triedec.engine.request import StopRule


class Prompts:
    """``tokenizer`` (a transformers tokenizer) for a model of ``vocab_size`` tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids for a string (plain tokenization, or the chat template if ``chat``), a list
        of chat messages (the chat template), or a list of token ids (used as is)."""
        return self.tokens(checked_prompt(prompt), chat)

    def tokens(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """:meth:`encode` for a prompt already checked for shape (a
        :class:`~triedec.api.generation.GenerationRequest`'s): only what needs the tokenizer and the
        vocabulary is checked here."""
        if isinstance(prompt, str):
            if chat:
                return self.tokens(({"role": "user", "content": prompt},))
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt[0], Mapping):
            if not self.has_chat_template:
                raise TriedecError("this model's tokenizer has no chat template; pass a string or token ids")
            text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = list(prompt)
            if any(t >= self.vocab_size for t in ids):  # type: ignore[operator]
                raise TriedecError(f"token ids must lie in [0, {self.vocab_size})")
        if not ids:
            raise TriedecError("the prompt is empty (no tokens)")
        return list(ids)

    def prepare(self, request: GenerationRequest, prompt_tokens: int, eos_token_ids: frozenset[int],
                max_context: int | None) -> tuple[StopRule, list[list[int]]]:
        """The checks that need the model (the context length ``max_context``, token ids against
        the vocabulary), then the request's stop rule (``eos_token_ids`` plus its own stop ids and
        strings) and its tokenized context documents."""
        if max_context is not None and prompt_tokens + request.max_new_tokens > max_context:
            raise TriedecError(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the "
                f"model's context of {max_context} tokens"
            )
        for t in request.stop_token_ids:
            if t >= self.vocab_size:
                raise TriedecError(f"stop token id {t!r} is not in [0, {self.vocab_size})")
        rule = StopRule(
            max_new_tokens=request.max_new_tokens,
            eos_token_ids=eos_token_ids | set(request.stop_token_ids),
            stop_strings=request.stop,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
        )
        documents = []
        for d in request.context:
            if isinstance(d, str):
                documents.append(self.tokenizer(d, add_special_tokens=False)["input_ids"])
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
