"""Constrained decoding in the pure core: a grammar as a value, what a request's grammar state must
answer (:class:`TokenConstraint`), and the acceptance rule that masks every node by it.

* :class:`Grammar` -- what a request's output must match: a JSON schema, any JSON object, a
  regular expression, one of several strings, a Lark or a GBNF grammar; validated for shape and size here
  (compiling it needs a tokenizer: :mod:`triedec.api.grammar`).
* :class:`TokenConstraint` -- one request's grammar state after its committed tokens: the tokens
  allowed after any path of draft tokens on top of them, whether a draft token may follow a path,
  the tokens the grammar forces next, and committing tokens.
* :class:`ConstrainedRule` -- an acceptance rule whose choice after a node is the inner rule's
  choice from the node's row with every token the grammar forbids after the node's own prefix set
  to ``-inf`` first (before the logit bias, penalties, temperature and filters, as vLLM and
  transformers apply a grammar's mask). ``ar`` chooses every token through the same function of
  (row, prefix), so every method returns ``ar``'s tokens under the same grammar, greedy and sampled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from triedec.core.accept import Acceptance, AcceptanceRule, NodeRows, memo, walk
from triedec.core.errors import TriedecError
from triedec.core.tree import TokenTree

GRAMMAR_KINDS: dict[str, str] = {
    "json_schema": "a JSON value that validates against the JSON schema given as JSON text",
    "json_object": "any JSON object (OpenAI's response_format json_object)",
    "regex": "text that matches the regular expression (Rust regex syntax, anchored at both ends)",
    "choice": "exactly one of the strings given as a JSON list",
    "lark": "text in the language of the Lark grammar (llguidance's dialect; the start rule is `start`)",
    "gbnf": "text in the language of the GBNF grammar (llama.cpp's dialect; the start rule is `root`)",
}
"""The kinds of :class:`Grammar` and what each one's output is."""

MAX_GRAMMAR_BYTES = 64 * 1024
"""The largest grammar source (UTF-8 bytes) a request may send: compiling it is bounded in time and
memory besides (:data:`triedec.api.grammar.PARSER_LIMITS`)."""

FORCED = "grammar"
"""The draft source of a token the grammar forces (the only token it allows there): drafted for
free and always accepted."""


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match: ``kind`` (one of :data:`GRAMMAR_KINDS`) and its
    ``source`` (the schema as JSON text, the regex, the choices as a JSON list of strings, the
    Lark or GBNF text; empty for ``json_object``). Build one with :meth:`json_schema`,
    :meth:`json_object`, :meth:`regex`, :meth:`choice`, :meth:`lark` or :meth:`gbnf`. Checked for
    shape and size here; whether the grammar compiles is checked when a request starts (a clear
    error either way)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise TriedecError(f"unknown grammar kind {self.kind!r}; available: {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(self.source, str):
            raise TriedecError(f"a grammar's source must be a string, got {type(self.source).__name__}")
        size = len(self.source.encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise TriedecError(f"the {self.kind} grammar is {size} bytes; the limit is {MAX_GRAMMAR_BYTES}")
        if self.kind == "json_object":
            if self.source:
                raise TriedecError("a json_object grammar takes no source")
        elif not self.source:
            raise TriedecError(f"a {self.kind} grammar needs its source")
        if self.kind == "json_schema":
            schema = _json(self.source, "the JSON schema")
            if not isinstance(schema, dict | bool):
                raise TriedecError(f"a JSON schema must be an object, got {type(schema).__name__}")
        if self.kind == "choice":
            options = _json(self.source, "the choices")
            if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
                raise TriedecError("choices must be a non-empty list of non-empty strings")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """Output that validates against ``schema`` (a mapping, or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output that matches ``pattern`` whole."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        """Output that is exactly one of ``options``."""
        if isinstance(options, str):
            raise TriedecError("choices must be a list of strings, not one string")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """Output in the language of the Lark grammar ``text``."""
        return cls("lark", text)

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """Output in the language of the GBNF grammar ``text`` (llama.cpp's ``--grammar``)."""
        return cls("gbnf", text)


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise TriedecError(f"{what} is not valid JSON: {exc}") from None


class TokenConstraint(Protocol):
    """One request's grammar state after the tokens it committed (:meth:`commit`). A ``path`` is
    a list of draft tokens on top of the committed ones (a tree node's ancestors below the root,
    then the node). Used by one thread at a time."""

    seconds: float
    """the wall time its calls took so far (what the grammar costs the request)"""

    def allowed(self, path: Sequence[int]) -> torch.Tensor:
        """A bool mask ``[vocab]``: the tokens the grammar allows after ``path`` (never empty: a
        grammar that allows nothing more allows the end-of-sequence tokens)."""
        ...

    def admits(self, path: Sequence[int], token: int) -> bool:
        """Whether ``token`` may follow ``path`` (``path`` itself admitted)."""
        ...

    def forced(self, limit: int, path: Sequence[int] = ()) -> list[int]:
        """At most ``limit`` tokens the grammar forces next after ``path`` (the only ones it
        allows there), in order; none after a path that ends the grammar."""
        ...

    def commit(self, tokens: Sequence[int]) -> None:
        """The request committed ``tokens`` (each allowed where it stands)."""
        ...

    def completed_by(self, tokens: Sequence[int]) -> int | None:
        """How many of ``tokens`` (each allowed where it stands) it takes to complete the grammar
        (nothing but end-of-sequence tokens may follow then), or None if they do not; changes
        nothing."""
        ...


def constrained_row(row: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``row [W]`` with every token id not in ``allowed [V]`` set to ``-inf`` (ids from ``V`` on,
    past the tokenizer's vocabulary, too); a new float32 tensor."""
    width = row.shape[-1]
    keep = torch.zeros(width, dtype=torch.bool)
    n = min(width, allowed.numel())
    keep[:n] = allowed[:n]
    return row.float().masked_fill(~keep, -math.inf)


@dataclass(frozen=True)
class ConstrainedRule:
    """``rule`` with each node's row masked by ``constraint`` after the node's own prefix (see
    the module doc). Masks are computed only for the nodes the walk reaches. ``processed`` is the
    inner rule's: the caller masks a row first (:func:`constrained_row`)."""

    rule: AcceptanceRule
    constraint: TokenConstraint = field(compare=False)

    @property
    def seed(self) -> int | None:
        return self.rule.seed

    @property
    def penalized(self) -> bool:
        return self.rule.penalized

    def processed(self, row: torch.Tensor, seen: torch.Tensor, position: int) -> torch.Tensor:
        return self.rule.processed(row, seen, position)

    def choose(self, row: torch.Tensor, seen: torch.Tensor, position: int) -> int:
        return self.rule.choose(row, seen, position)

    def accept(self, tree: TokenTree, logits: torch.Tensor, context: Sequence[int], position: int) -> Acceptance:
        nodes = NodeRows(tree, logits, context, position, self.penalized)

        def choose(i: int) -> int:
            row = constrained_row(nodes.row(i), self.constraint.allowed(nodes.path(i)))
            return self.rule.choose(row, nodes.seen(i), nodes.position(i))

        return walk(tree, memo(choose))
