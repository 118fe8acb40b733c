"""Grammars: every method returns ar's tokens under the same grammar, greedy and sampled, and the
output matches the grammar (docs/structured-output.md)."""

from __future__ import annotations

import json

import pytest

from triedec import Grammar
from triedec.core.errors import TriedecError

pytestmark = pytest.mark.default_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
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
