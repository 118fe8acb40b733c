"""Grammars compiled for one tokenizer, and each request's grammar state: llguidance underneath.

llguidance (Microsoft's grammar engine, Rust, no dependencies) was chosen by measurement on this
project's CPUs over xgrammar (``scripts/grammar_engines.py``; the figures are in
docs/structured-output.md): its mask over the vocabulary costs a small share of a forward, it gives
the tokens a grammar forces as tokens (what the engine drafts for free), and it needs neither
triton nor a compiler at install.

:class:`Grammars` belongs to an :class:`~triedec.api.lm.LM`: it builds the tokenizer's llguidance
view once (on first use), compiles each :class:`~triedec.core.grammar.Grammar` once (an LRU of
:data:`CACHE_SIZE`) under :data:`PARSER_LIMITS`, and hands each request a copy of the compiled
matcher as its :class:`GrammarState` (a :class:`~triedec.core.grammar.TokenConstraint`). A grammar
that does not compile, or exceeds the limits, is a :class:`~triedec.core.errors.TriedecError` that says why.
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from triedec.core.errors import TriedecError
from triedec.core.grammar import Grammar

CACHE_SIZE = 64
"""Compiled grammars kept per model (least recently used dropped first)."""

JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": r"[ ]?|\n[ ]{0,16}", "item_separator": ",",
                "key_separator": ":"}
"""How JSON may be laid out: the model picks, between any two tokens of the JSON, nothing, one
space, or a newline and at most 16 spaces of indentation (compact, ``json.dumps``'s or pretty
printed, as models were trained on; llama.cpp's JSON grammars allow the like), so a model writes
its own layout but cannot wander into endless whitespace. Tool calls' arguments are laid out as
``json.dumps`` (:mod:`triedec.api.tools`)."""

PARSER_LIMITS = {"initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
                 "max_lexer_states": 20_000, "max_grammar_size": 200_000}
"""llguidance's parser limits every grammar compiles and runs under: the lexer fuel of compiling
and of each token's mask, the parser items a token may take, the lexer states (~1-2 kB each), the
grammar symbols. What they cost in time on this project's CPU is in docs/structured-output.md."""


def _source(grammar: Grammar) -> str:
    """``grammar`` as an llguidance grammar."""
    import llguidance

    match grammar.kind:
        case "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(grammar.source, defaults=JSON_OPTIONS)
        case "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(grammar.source)
        case "choice":
            options = json.loads(grammar.source)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        case "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(grammar.source)
            except Exception as exc:  # llguidance's converter raises its own error types
                raise ValueError(f"not valid GBNF: {exc}") from None
            return llguidance.LLMatcher.grammar_from_lark(lark)
        case _:
            return llguidance.LLMatcher.grammar_from_lark(grammar.source)


GRAMMAR_CALL_SECONDS = 0.05
"""What one call of a request's grammar may take (a token's mask, a draft path's check, the
forced tokens, a commit: llguidance's work on the engine thread, which every batched request
waits on). At compile time :meth:`Grammars.check` times the first token's mask and forced tokens
(the better of two trials) and refuses a grammar over it; while a request decodes, its grammar's
calls taking more than this on average (or one taking 10x it) end that request alone with the
reason. A JSON schema's or a short regex's mask takes ~0.1-3 ms here; ``a{10000}``
~10 ms, ``a{100000}`` ~160 ms (docs/structured-output.md)."""

MAX_REPETITIONS = 10_000
"""The most times a regex's bounded repetitions may repeat their part, nested counts multiplied
(``a{100}{100}`` counts 10,000): a mask's cost grows with it, so a larger one is refused before it
compiles."""

_DETAIL = re.compile(r"\s+")
_COUNT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def repetitions(pattern: str) -> int:
    """The largest product of nested bounded repetition counts in ``pattern`` (``{n}``, ``{m,n}``
    counted as ``n``, ``{m,}`` as ``m``), a quantified group's count multiplying every count inside
    it; 1 without any. A cheap over-estimate where the syntax is unusual (a brace inside a class)."""
    groups: list[int] = []  # where each open group starts
    spans: list[tuple[int, int]] = []  # (start, end) of each closed group
    i = 0
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
            continue
        if pattern[i] == "(":
            groups.append(i)
        elif pattern[i] == ")" and groups:
            spans.append((groups.pop(), i))
        i += 1
    counts = {m.start(): int(m.group(2)) if m.group(2) else int(m.group(1)) for m in _COUNT.finditer(pattern)}
    best = 1
    for at, count in counts.items():
        product = count
        for start, end in spans:  # each group around this count, times the group's own count
            if start < at < end:
                product *= counts.get(end + 1, 1)
        best = max(best, product)
    return best

_T = TypeVar("_T")


def _timed(method: Callable[..., _T]) -> Callable[..., _T]:
    """``method`` of :class:`GrammarState` with its wall time added to the state's ``seconds``."""

    @functools.wraps(method)
    def timed(self: GrammarState, *args: Any) -> _T:
        started = time.perf_counter()
        try:
            result = method(self, *args)
        finally:
            took = time.perf_counter() - started
            self.seconds += took
            self.calls += 1
        mean = self.seconds / self.calls
        if (self.calls >= 2 and mean > self.call_seconds) or took > 10 * self.call_seconds:
            raise TriedecError(f"the grammar is too slow: its calls took {1e3 * mean:.0f} ms each on average (the "
                               f"last {1e3 * took:.0f} ms), over the {1e3 * self.call_seconds:.0f} ms a grammar may "
                               "take a token")
        return result

    return timed


class GrammarState:
    """One request's grammar state (:class:`~triedec.core.grammar.TokenConstraint`) over
    llguidance's matcher; ``vocab``: the model's logits width, ``eos``: its end-of-sequence ids.
    ``seconds``: the wall time its calls took so far (masks, draft checks, forced tokens, commits)."""

    def __init__(self, matcher: Any, vocab: int, eos: Iterable[int], call_seconds: float = GRAMMAR_CALL_SECONDS
                 ) -> None:
        import llguidance.torch

        self.seconds = 0.0
        self.calls = 0
        self.call_seconds = call_seconds
        """what a call may take (:data:`GRAMMAR_CALL_SECONDS`): once the calls so far take more on
        average (or one takes 10x it), the call raises"""
        self._m, self._vocab = matcher, vocab
        self._eos = sorted(t for t in eos if 0 <= t < vocab)
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._bits = llguidance.torch.allocate_token_bitmask(1, vocab)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def _mask(self) -> torch.Tensor:
        self._fill(self._m, self._bits, 0)
        if self._m.is_error():  # past llguidance's limits, or a state nothing can follow
            raise TriedecError(f"the grammar failed: {_DETAIL.sub(' ', self._m.get_error()).strip()[:300]}")
        allowed = ((self._bits[0].unsqueeze(1) >> self._shifts) & 1).bool().flatten()[: self._vocab]
        if not bool(allowed.any()):
            allowed[self._eos] = True
        return allowed

    @_timed
    def allowed(self, path: Sequence[int]) -> torch.Tensor:
        path = list(path)
        if not path:
            return self._mask()
        consumed = self._m.try_consume_tokens(path)
        try:
            if consumed != len(path):
                if self._m.is_stopped():  # the path ends the grammar (its end-of-sequence): generation ends there
                    allowed = torch.zeros(self._vocab, dtype=torch.bool)
                    allowed[self._eos] = True
                    return allowed
                raise TriedecError("internal error: a draft path the grammar does not admit reached the mask")
            return self._mask()
        finally:
            self._m.rollback(consumed)

    @_timed
    def admits(self, path: Sequence[int], token: int) -> bool:
        whole = [*path, token]
        return token < self._vocab and self._m.validate_tokens(whole) == len(whole)

    @_timed
    def forced(self, limit: int, path: Sequence[int] = ()) -> list[int]:
        if limit <= 0:
            return []
        path = list(path)
        consumed = self._m.try_consume_tokens(path) if path else 0
        try:
            if consumed != len(path) or self._m.is_stopped():
                return []
            forced = list(self._m.compute_ff_tokens())[:limit]
            if self._m.is_error():
                raise TriedecError(f"the grammar failed: {_DETAIL.sub(' ', self._m.get_error()).strip()[:300]}")
            return forced
        finally:
            if consumed:
                self._m.rollback(consumed)

    @_timed
    def commit(self, tokens: Sequence[int]) -> None:
        if tokens and not self._m.consume_tokens(list(tokens)):
            raise TriedecError(f"internal error: the grammar refused a committed token: {self._m.get_error()}")

    @_timed
    def completed_by(self, tokens: Sequence[int]) -> int | None:
        for j, t in enumerate(tokens):
            if not self._m.consume_token(t):
                self._m.rollback(j)
                raise TriedecError(f"internal error: the grammar refused a chosen token: {self._m.get_error()}")
            if self._m.is_stopped():
                self._m.rollback(j + 1)
                return j + 1
        self._m.rollback(len(tokens))
        return None


class Grammars:
    """The grammars of one model: ``tokenizer`` (a transformers tokenizer), ``vocab`` (the
    logits width) and ``eos`` (the end-of-sequence ids a complete grammar allows). Thread-safe."""

    def __init__(self, tokenizer: Any, vocab: int, eos: Iterable[int], call_seconds: float = GRAMMAR_CALL_SECONDS
                 ) -> None:
        self._tokenizer, self._vocab, self._eos = tokenizer, vocab, sorted(eos)
        self.call_seconds = call_seconds
        """the most one call of a grammar may take (:data:`GRAMMAR_CALL_SECONDS`)"""
        self._lock = threading.Lock()
        self._ll: Any = None
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()

    def _lltokenizer(self) -> Any:
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab,
                                                    eos_token=self._eos or None)
        return self._ll

    def check(self, grammar: Grammar) -> None:
        """Raise :class:`~triedec.core.errors.TriedecError` if ``grammar`` does not compile, admits
        no output (its first token's mask is empty, or llguidance fails on it: an empty language,
        a ``$ref`` cycle), or is too slow to run (a regex repeating more than
        :data:`MAX_REPETITIONS` times; a first token's mask and forced tokens that take more than
        :attr:`call_seconds`). A grammar that passes is compiled and cached, and not timed again."""
        with self._lock:
            self._matcher(grammar)

    def state(self, grammar: Grammar) -> GrammarState:
        """A fresh state of ``grammar`` for one request (compiled and checked once, then copied)."""
        with self._lock:
            copy = self._matcher(grammar).deep_copy()
        return GrammarState(copy, self._vocab, self._eos, self.call_seconds)

    def _first_step(self, grammar: Grammar, matcher: Any) -> None:
        """Refuse ``grammar`` (its compiled ``matcher``) unless its first token's mask admits a
        token and it and the forced tokens take at most :attr:`call_seconds` (on a copy)."""
        import llguidance.torch

        bits = llguidance.torch.allocate_token_bitmask(1, self._vocab)
        took = math.inf
        for _ in range(2):  # the better of two trials: a busy machine's pause is not the grammar's cost
            trial = matcher.deep_copy()
            started = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(trial, bits, 0)
            if not trial.is_error():
                trial.compute_ff_tokens()
            took = min(took, time.perf_counter() - started)
            if trial.is_error() or took <= self.call_seconds:
                break
        if trial.is_error():
            detail = _DETAIL.sub(" ", trial.get_error()).strip()[:300]
            raise TriedecError(f"the {grammar.kind} grammar admits no output ({detail})")
        if not bool((bits != 0).any()) and not trial.is_accepting():
            raise TriedecError(f"the {grammar.kind} grammar admits no output: no token can start it")
        if took > self.call_seconds:
            raise TriedecError(f"the {grammar.kind} grammar is too slow: its first token took {1e3 * took:.0f} ms, "
                               f"over the {1e3 * self.call_seconds:.0f} ms a grammar may take a token")

    def _matcher(self, grammar: Grammar) -> Any:
        """``grammar``'s compiled matcher (under the lock)."""
        import llguidance

        matcher = self._compiled.get(grammar)
        if matcher is None:
            tokenizer = self._lltokenizer()
            if grammar.kind == "regex" and repetitions(grammar.source) > MAX_REPETITIONS:
                raise TriedecError(f"the regex grammar repeats a part {repetitions(grammar.source)} times (nested "
                                   f"counts multiplied); the limit is {MAX_REPETITIONS}: a mask's cost grows with it")
            try:
                source = _source(grammar)
            except ValueError as exc:
                raise TriedecError(f"the {grammar.kind} grammar is invalid: {exc}") from None
            limits = llguidance.LLParserLimits(**PARSER_LIMITS, verbose_errors=False)
            matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=limits)
            if matcher.is_error():
                detail = _DETAIL.sub(" ", matcher.get_error()).strip()[:500]
                raise TriedecError(f"the {grammar.kind} grammar does not compile: {detail}")
            self._first_step(grammar, matcher)
            self._compiled[grammar] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return matcher
