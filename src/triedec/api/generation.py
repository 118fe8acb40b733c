"""One generation request as a value: what to generate and how, validated once, where it is built.

:class:`GenerationRequest` is what :meth:`triedec.LM.start` takes, and what every other way in
(``LM.generate``, ``LM.stream``, ``LM.generate_batch``, the server, the benchmark, the CLI and the
``custom_generate`` drop-in) builds before it calls ``start``. Every default of a request lives
here (:data:`MAX_NEW_TOKENS`; sampling's in :class:`~triedec.core.sampling.Sampling`; a method's in its
options class).

Construction checks everything that does not depend on a model: types and ranges, the method's
name and its options (parsed into the method's frozen options value), stop strings and context
documents. What depends on the model (token ids against its vocabulary, the context length, a chat
template) is checked by ``LM.start``, which also draws a seed for a sampling request without one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from triedec.core.errors import TriedecError, positive_int
from triedec.core.grammar import Grammar
from triedec.core.params import DEFAULT_METHOD, MAX_NEW_TOKENS, Logprobs
from triedec.core.sampling import Sampling
from triedec.drafters.registry import keyword_names, reserve_option_names
from triedec.engine.methods import method as find_method

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]
"""A string, a list of chat messages (``{"role": ..., "content": ...}``), or token ids."""


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate, validated on construction.

    * ``prompt``: a string (tokenized as is, or through the chat template when ``chat``), chat
      messages (always through the chat template), or token ids (used as they are); kept as a
      tuple when it is a list;
    * ``method``: a method's name (``triedec methods``); ``options``: its options, given as a
      mapping of name to value (or the options value itself) and kept as the method's frozen
      options value, defaults filled in;
    * ``max_new_tokens`` >= 1; ``stop``: strings that end generation like EOS (the stopping token
      is kept, nothing after it); ``stop_token_ids``: extra EOS ids;
    * ``context``: extra documents (strings or token ids) that context-based drafters may draft from;
    * ``sampling``: how each token is chosen (:class:`~triedec.core.sampling.Sampling`; greedy by default);
    * ``logprobs``: what to report of each new token's probability (:class:`~triedec.core.params.Logprobs`:
      its logprob and the ``top`` most likely alternatives, ``raw`` or ``processed``); None: nothing;
    * ``ignore_eos``: the model's end-of-sequence tokens do not stop generation (``stop_token_ids``
      still do; vLLM's, what benchmark clients send to get ``max_new_tokens`` tokens);
    * ``grammar``: what the output must match (:class:`~triedec.core.grammar.Grammar`: a JSON schema,
      any JSON object, a regex, a choice, a Lark grammar); None: anything. Every token is chosen
      from the tokens the grammar allows after its prefix, so every method still returns ``ar``'s
      tokens; a complete grammar ends generation (``docs/structured-output.md``).

    :meth:`of` builds one from ``LM.generate``'s keyword arguments.
    """

    prompt: Prompt
    method: str = DEFAULT_METHOD
    options: Any = field(default_factory=dict)
    max_new_tokens: int = MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    context: tuple[str | tuple[int, ...], ...] = ()
    chat: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    logprobs: Logprobs | None = None
    ignore_eos: bool = False
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        found = find_method(self.method)
        options = self.options
        if options is None or isinstance(options, Mapping):
            options = found.make_options(dict(options or {}))
        elif not isinstance(options, found.spec.options):
            raise TriedecError(f"options for method {self.method!r} must be a mapping or a "
                               f"{found.spec.options.__name__}, got {type(options).__name__}")
        _set(self, "options", options)
        _set(self, "prompt", checked_prompt(self.prompt))
        positive_int("max_new_tokens", self.max_new_tokens)
        _set(self, "stop", _checked_stop(self.stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise TriedecError(f"stop_token_ids must be a list of token ids, got {type(ids).__name__}")
        for t in ids:
            if not _is_id(t):
                raise TriedecError(f"stop token id {t!r} is not a token id (an integer >= 0)")
        _set(self, "stop_token_ids", tuple(ids))
        _set(self, "context", _checked_context(self.context))
        if not isinstance(self.chat, bool):
            raise TriedecError(f"chat must be true or false, got {self.chat!r}")
        if not isinstance(self.sampling, Sampling):
            raise TriedecError(f"sampling must be a Sampling, got {type(self.sampling).__name__}")
        if not isinstance(self.ignore_eos, bool):
            raise TriedecError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise TriedecError(f"grammar must be a Grammar or None, got {type(self.grammar).__name__} (build one with "
                               "Grammar.json_schema(...), Grammar.regex(...), ...)")
        if self.logprobs is not None and not isinstance(self.logprobs, Logprobs):
            raise TriedecError(f"logprobs must be a Logprobs or None, got {type(self.logprobs).__name__}")

    @classmethod
    def of(
        cls,
        prompt: Prompt,
        method: str = DEFAULT_METHOD,
        *,
        max_new_tokens: int = MAX_NEW_TOKENS,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        context: Sequence[str | Sequence[int]] = (),
        chat: bool = False,
        temperature: float = Sampling.temperature,
        top_k: int = Sampling.top_k,
        top_p: float = Sampling.top_p,
        min_p: float = Sampling.min_p,
        repetition_penalty: float = Sampling.repetition_penalty,
        seed: int | None = Sampling.seed,
        presence_penalty: float = Sampling.presence_penalty,
        frequency_penalty: float = Sampling.frequency_penalty,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int = Sampling.min_tokens,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        logprobs_mode: str = Logprobs.mode,
        prompt_logprobs: bool = Logprobs.prompt,
        grammar: Grammar | None = None,
        **options: object,
    ) -> GenerationRequest:
        """The request for ``LM.generate``'s keyword arguments: the sampling parameters (with
        OpenAI's penalties and ``logit_bias``, vLLM's ``min_tokens``) become a
        :class:`~triedec.core.sampling.Sampling`; ``logprobs`` (None: none; k in 0-20: each token's
        logprob and the k most likely alternatives), ``logprobs_mode`` and ``prompt_logprobs`` (the
        prompt's tokens scored too) a :class:`~triedec.core.params.Logprobs`; ``grammar`` what the
        output must match; every other keyword is an option of ``method``."""
        sampling = Sampling(temperature, top_k, top_p, min_p, repetition_penalty, seed, presence_penalty,
                            frequency_penalty, () if logit_bias is None else logit_bias, min_tokens)  # type: ignore[arg-type]
        asked = None
        if logprobs is not None or prompt_logprobs:
            asked = Logprobs(0 if logprobs is None else logprobs, logprobs_mode, prompt_logprobs)
        return cls(prompt=prompt, method=method, options=options, max_new_tokens=max_new_tokens,
                   stop=stop, stop_token_ids=stop_token_ids, context=context, chat=chat,  # type: ignore[arg-type]
                   sampling=sampling, logprobs=asked, ignore_eos=ignore_eos, grammar=grammar)


reserve_option_names(keyword_names(GenerationRequest.of, "options"), "GenerationRequest.of")


def vars_of(options: Any) -> dict[str, object]:
    """A method's options value as a mapping of option name to value."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def _set(request: GenerationRequest, name: str, value: object) -> None:
    object.__setattr__(request, name, value)  # normalising a frozen value in __post_init__


def _is_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def check_unicode(what: str, text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as ``\\ud800``, which JSON can
    carry but no tokenizer can encode) with an error that says so."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TriedecError(f"{what} is not valid Unicode: character {exc.start} is a lone surrogate "
                           f"(U+{ord(text[exc.start]):04X}), which has no UTF-8 encoding") from None


def checked_prompt(prompt: object) -> Prompt:
    """``prompt`` checked for shape (see :data:`Prompt`), lists as tuples."""
    if isinstance(prompt, str):
        if not prompt:
            raise TriedecError("the prompt is empty")
        check_unicode("the prompt", prompt)
        return prompt
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        for i, message in enumerate(prompt):
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    got = "missing" if key not in message else f"a {type(message[key]).__name__}"
                    raise TriedecError(f"chat message {i}: {key!r} must be a string, got {got}")
                check_unicode(f"chat message {i}'s {key}", message[key])
        return tuple(dict(m) for m in prompt)
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise TriedecError("the prompt is empty (no tokens)")
        if any(t < 0 for t in prompt):
            raise TriedecError("token ids must be >= 0")
        return tuple(prompt)
    raise TriedecError("prompt must be a string, a list of chat messages, or a list of token ids")


def _checked_stop(stop: object) -> tuple[str, ...]:
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence):
        raise TriedecError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for s in stops:
        if not isinstance(s, str):
            raise TriedecError(f"stop strings must be strings, got {type(s).__name__}")
        if not s:
            raise TriedecError("stop strings must be non-empty")
        check_unicode("a stop string", s)
    return tuple(stops)


def _checked_context(context: object) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(context, str | bytes) or not isinstance(context, Sequence):
        raise TriedecError("context must be a list of documents (strings or token-id lists), not a "
                           f"{type(context).__name__}; wrap a single document as [text]")
    documents: list[str | tuple[int, ...]] = []
    for d in context:
        if isinstance(d, str):
            check_unicode("a context document", d)
            documents.append(d)
        elif isinstance(d, Sequence) and not isinstance(d, bytes) and all(_is_id(t) for t in d):
            documents.append(tuple(d))
        else:
            raise TriedecError(f"each context document must be a string or a list of token ids (integers >= 0), "
                               f"got {type(d).__name__}")
    return tuple(documents)
