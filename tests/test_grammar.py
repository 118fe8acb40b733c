"""Grammars: every method returns ar's tokens under the same grammar, greedy and sampled, and the
output matches the grammar (docs/structured-output.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triedec import Grammar
from triedec.api.generation import GenerationRequest
from triedec.core.errors import TriedecError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                           "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "tags", "role"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "Extract as JSON: Ada Lovelace, 36 years old, a mathematician and poet, "
                                      "is an admin."}]
METHODS = ["pld", "ngram-trie", "recycling", "lookahead", "auto"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_method_equals_ar_under_a_json_schema(default_mode_lm, temperature: float) -> None:
    grammar = Grammar.json_schema(SCHEMA)
    ar = default_mode_lm.generate(PROMPT, "ar", max_new_tokens=96, grammar=grammar, temperature=temperature, seed=7)
    value = json.loads(ar.text)
    assert set(value) == set(SCHEMA["required"]) and value["role"] in ("admin", "user")
    assert ar.stats.stop_reason == "grammar"
    forced = 0
    for method in METHODS:
        out = default_mode_lm.generate(PROMPT, method, max_new_tokens=96, grammar=grammar, temperature=temperature,
                                       seed=7)
        assert out.token_ids == ar.token_ids, method
        forced += out.stats.accepted_by_origin.get("grammar", 0)
    assert forced > 0  # forced tokens were drafted and accepted


def test_regex_and_choice(default_mode_lm) -> None:
    out = default_mode_lm.generate(PROMPT, "auto", max_new_tokens=12, grammar=Grammar.regex(r"[0-9]{3}-[a-z]{2}"))
    assert len(out.text) == 6 and out.text[:3].isdigit() and out.text[3] == "-"
    out = default_mode_lm.generate(PROMPT, "auto", max_new_tokens=12, grammar=Grammar.choice(["yes", "no"]))
    assert out.text in ("yes", "no")


def test_bad_grammars_are_clear_errors(default_mode_lm) -> None:
    with pytest.raises(TriedecError, match="not valid JSON"):
        Grammar("json_schema", "{nope")
    with pytest.raises(TriedecError, match="does not compile"):
        default_mode_lm.generate(PROMPT, "ar", max_new_tokens=4, grammar=Grammar.lark("start: ("))
    with pytest.raises(TriedecError, match="limit"):
        Grammar.regex("a" * 70_000)


def test_a_learned_answer_drafted_past_the_grammars_end(default_mode_lm) -> None:
    """``auto`` remembers an answer and drafts it whole, its end-of-sequence after the grammar's
    end included: that node's row is masked to end-of-sequence, not refused."""
    grammar = Grammar.json_schema(SCHEMA)
    fresh = default_mode_lm.fresh()
    want = fresh.generate(PROMPT, "ar", max_new_tokens=96, grammar=grammar).token_ids
    for _ in range(3):
        out = fresh.generate(PROMPT, "auto", max_new_tokens=96, grammar=grammar)
        assert out.token_ids == want and out.stats.stop_reason == "grammar"


TINY_GRAMMARS = [
    Grammar.choice(["one two three four five six seven eight", "one two three", "Hello there! How are you today?"]),
    Grammar.regex(r"(one|two|three|sea|sky)( (one|two|three|sea|sky)){2,12}\."),
    Grammar.json_schema({"type": "object", "properties": {"word": {"enum": ["one two three", "the sea", "sky"]},
                                                         "ok": {"type": "boolean"},
                                                         "list": {"type": "array", "items": {"enum": ["a", "b"]},
                                                                  "maxItems": 5}},
                         "required": ["word", "ok", "list"], "additionalProperties": False}),
    Grammar.lark('start: "Tell me " ("a story" | "about the " WORD) "."\nWORD: /[a-z]{1,12}/'),
]
TINY_METHODS = ["pld", "ngram-trie", "recycling", "lookahead", "auto"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**20), which=st.integers(0, len(TINY_GRAMMARS) - 1), sampled=st.booleans(),
       budget=st.sampled_from([3, 8, 512]))
def test_tiny_every_method_equals_ar_alone_and_in_a_batch(lm, seed: int, which: int, sampled: bool,
                                                         budget: int) -> None:
    """On the tiny random model, under each kind of grammar, greedy and sampled: every method's
    tokens equal ``ar``'s alone, and in a batch beside unconstrained requests and another grammar
    under a small verify budget (``max_tokens_per_forward``)."""
    from helpers import _CORPUS as PROMPTS

    grammar = TINY_GRAMMARS[which]
    prompt = PROMPTS[seed % len(PROMPTS)] + " one two three one two three"
    options = {"max_new_tokens": 40, "temperature": 0.9 if sampled else 0.0, "seed": seed}
    want = lm.generate(prompt, "ar", grammar=grammar, **options)
    saved = lm.limits
    lm.limits = dataclasses.replace(saved, max_tokens_per_forward=budget)
    try:
        for method in TINY_METHODS:
            out = lm.generate(prompt, method, grammar=grammar, **options)
            assert out.token_ids == want.token_ids, (method, "alone")
            other = TINY_GRAMMARS[(which + 1) % len(TINY_GRAMMARS)]
            batch = [GenerationRequest.of(prompt, method, grammar=grammar, **options),
                     GenerationRequest.of(PROMPTS[0], method, **options),
                     GenerationRequest.of(prompt, method, grammar=other, **options),
                     GenerationRequest.of(PROMPTS[1], method, **options)]
            results = lm.generate_batch(batch, progress=False)
            assert results[0].token_ids == want.token_ids, (method, "batch")
            assert results[1].token_ids == lm.generate(PROMPTS[0], "ar", **options).token_ids, (method, "free")
    finally:
        lm.limits = saved


@pytest.mark.parametrize("why", ["plain step", "gated"])
def test_forced_tokens_are_drafted_on_steps_that_do_not_draft(lm, monkeypatch, why: str) -> None:
    """A grammar's forced tokens are accepted for certain, so a drafting method drafts them on a
    step where it drafts nothing of its own: a batch's plain step (``measure_drafting`` found
    drafting does not pay) or a step its gate skips. The tokens stay ``ar``'s; the gate hears
    nothing of forced tokens (they are no evidence that the drafter pays)."""
    from helpers import together

    from triedec.core.allocate import DraftGate
    from triedec.engine import batch as batch_module

    heard: list[tuple[int, int, int]] = []

    class Never(DraftGate):
        def proposes(self) -> bool:
            return False

        def verified(self, proposed: int, verified: int, accepted: int = 0, draft_seconds: float = 0.0) -> None:
            heard.append((proposed, verified, accepted))

    monkeypatch.setattr(batch_module, "DraftGate", Never)
    options = {"max_new_tokens": 40, "grammar": TINY_GRAMMARS[2]}
    want = lm.generate("Say it as JSON:", "ar", **options).token_ids
    run = lm.start(GenerationRequest.of("Say it as JSON:", "recycling", **options))
    batch = batch_module.Batch(lm.adapter, lm.cost_model(), lm.limits, measure_drafting=why == "plain step",
                               gate_drafts=why == "gated")
    if batch.payoff is not None:
        monkeypatch.setattr(batch.payoff, "drafts", lambda load, measured=True: False)
    [(tokens, outcome)], _ = together(lm.adapter, [run], batch=batch)
    assert tokens == want
    assert outcome.stats.accepted_by_origin.get("grammar", 0) > 0
    assert heard if why == "gated" else not heard
    assert all(h == (0, 0, 0) for h in heard)


class _Scripted:
    """A grammar state for unit tests: the paths it admits (every prefix of ``words``), and the
    tokens it forces after a path (``forces``)."""

    seconds = 0.0

    def __init__(self, words: list[list[int]], forces: dict[tuple[int, ...], list[int]]) -> None:
        self.prefixes = {tuple(w[:k]) for w in words for k in range(len(w) + 1)}
        self.forces = forces

    def admits(self, path, token) -> bool:
        return (*path, token) in self.prefixes

    def forced(self, limit, path=()) -> list[int]:
        return self.forces.get(tuple(path), [])[:limit]


def test_a_drafted_leaf_is_followed_by_the_tokens_the_grammar_forces_after_it() -> None:
    """Root 0; the drafter proposes 1 -> 2 and 3 (forbidden) and 1 -> 4: after [1, 2] the grammar
    forces 7, 8, after [1, 4] it forces 9. The cut node goes, each kept leaf gets its chain right
    after it (topological, best first), with its chance, source ``grammar`` and no drafter index."""
    from triedec.core.tree import TokenTree
    from triedec.drafters.base import Draft
    from triedec.engine.constrained import constrained_draft

    tree = TokenTree((0, 1, 2, 3, 4), (-1, 0, 1, 0, 1))
    draft = Draft(tree, (1.0, 0.6, 0.5, 0.4, 0.2), 1, ((), ("context",), ("context",), ("context",), ("context",)))
    state = _Scripted([[1, 2, 7, 8], [1, 4, 9]], {(1, 2): [7, 8], (1, 4): [9]})
    new, own = constrained_draft(draft, state, (), extend=4, limit=8)
    assert new.tree.tokens == (0, 1, 2, 7, 8, 4, 9)
    assert new.tree.parents == (-1, 0, 1, 2, 3, 1, 5)
    assert new.chances == (1.0, 0.6, 0.5, 0.5, 0.5, 0.2, 0.2)
    assert own == (0, 1, 2, -1, -1, 4, -1)
    assert new.sources[3] == new.sources[6] == ("grammar",) and new.required == 1
    # one leaf only, and chains cut at the limit
    new, own = constrained_draft(draft, state, (), extend=1, limit=1)
    assert new.tree.tokens == (0, 1, 2, 7, 4) and own == (0, 1, 2, -1, 4)
    # nothing to extend (ar drafts nothing): the draft as it was, less the cut node
    new, own = constrained_draft(draft, state, (), extend=0, limit=8)
    assert new.tree.tokens == (0, 1, 2, 4) and own == (0, 1, 2, 4)


def test_the_extraction_benchmarks_tasks_are_well_formed(default_mode_lm) -> None:
    """The JSON-extraction tasks (scripts/json_bench.py): 30 to time and 6 to develop on, each
    schema a valid JSON schema that compiles, no text shared between tasks."""
    import jsonschema

    from triedec.bench.datasets import extraction_tasks

    every = extraction_tasks("all")
    assert len(extraction_tasks("evaluation")) == 30 and len(extraction_tasks("development")) == 6
    assert len({t.id for t in every}) == len({t.prompt for t in every}) == 36
    for task in every:
        jsonschema.Draft202012Validator.check_schema(task.schema)
        default_mode_lm.grammars.check(Grammar.json_schema(task.schema))
    with pytest.raises(TriedecError, match="unknown split"):
        extraction_tasks("tuning")
