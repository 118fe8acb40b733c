"""Where each token came from (triedec.core.trace): every method's step records, on tiny random models
and through the server, against the tokens it returned and its own stats."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from helpers import drain

import triedec
from triedec.api.generation import GenerationRequest
from triedec.bench.load import serving
from triedec.core.errors import TriedecError
from triedec.core.trace import MODEL, StepTrace
from triedec.core.tree import TokenTree
from triedec.drafters.base import SOURCES, UNNAMED, BaseDrafter, Draft
from triedec.engine.methods import methods
from triedec.engine.request import Request, StopRule
from triedec.server import ServerConfig, create_app

SPECULATIVE = [name for name, m in methods().items() if m.equals == "greedy"]
REPEATING = "the cat sat on the mat and the cat sat on the mat and the cat sat on the mat"


def traced(lm, method, prompt=REPEATING, **kwargs):
    run = lm.start(GenerationRequest.of(prompt, method, **kwargs))
    run.record_steps()
    tokens, outcome = drain(triedec.engine.batch.run_alone(lm.adapter, run, lm.cost_model(), lm.limits))
    return tokens, outcome, run.take_steps()


def check_steps(tokens, stats, steps, stop_inside=False):
    """The records account for every returned token, their origins count to the stats, and each
    step's tokens are its accepted path's drafts then the model's own token."""
    assert [t for s in steps for t in s.tokens] == tokens
    counts = Counter(o for s in steps for o in s.origins)
    assert dict(counts) == stats.accepted_by_origin
    assert sum(counts.values()) == stats.new_tokens == len(tokens)
    assert steps[0].step == 0 and steps[0].origins == (MODEL,) and steps[0].tree is None
    assert [len(s.tokens) for s in steps[1:]] == stats.accepted_per_step
    cuts = 0
    for s in steps[1:]:
        path = s.accepted
        drafts = [s.tree.tokens[i] for i in path[1:]]
        whole = len(s.tokens) == len(path)  # not cut by a stop inside the accepted drafts
        assert list(s.tokens) == ([*drafts, s.tokens[-1]] if whole else drafts[: len(s.tokens)])
        want = [s.tree_sources[i][0] for i in path[1:]] + ([MODEL] if whole else [])
        assert list(s.origins) == want[: len(s.tokens)]
        if not whole:
            assert stop_inside
            cuts += 1
        assert all(o in SOURCES or o in (MODEL, UNNAMED, "oracle") for o in s.origins)
    return cuts


@pytest.mark.parametrize("method", SPECULATIVE)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_method_records_each_step_and_its_origins(lm, method, temperature):
    tokens, outcome, steps = traced(lm, method, max_new_tokens=40, temperature=temperature, seed=3)
    check_steps(tokens, outcome.stats, steps)
    plain, _ = drain(lm.stream(REPEATING, "ar", max_new_tokens=40, temperature=temperature, seed=3))
    assert tokens == plain  # recording changes nothing


def test_drafts_are_accepted_and_named_on_a_repeating_prompt(lm):
    """Non-vacuous: the context trie's drafts are accepted here, and reported as ``context``."""
    tokens, outcome, steps = traced(lm, "ngram-trie", max_new_tokens=60)
    assert outcome.stats.accepted_by_origin.get("context", 0) > 0
    check_steps(tokens, outcome.stats, steps)


class Oracle(BaseDrafter):
    """Drafts the next 4 tokens of a known answer: every step accepts 4 drafts and the model's own."""

    def __init__(self, prompt, answer):
        self.prompt, self.answer = len(prompt), answer

    def propose(self, context):
        done = len(context) - self.prompt
        chain = self.answer[done : done + 4]
        return Draft.fixed(TokenTree((context[-1], *chain), tuple(range(-1, len(chain))))).labelled("oracle")


def test_a_stop_inside_accepted_drafts_keeps_the_records_exact(lm):
    """A stop token inside a step's accepted drafts: the record holds only the tokens kept."""
    prompt = lm.encode(REPEATING)
    answer, _ = drain(lm.stream(prompt, "ar", max_new_tokens=30))
    # output positions 1-4, 6-9, ... are drafts (0 is the prefill's, 5, 10, ... the model's own)
    inside = [k for k in range(1, len(answer)) if k % 5 and answer.index(answer[k]) == k]
    assert inside
    for k in inside[:3]:
        run = Request(Oracle(prompt, answer), prompt, StopRule(30, frozenset({answer[k]})))
        run.record_steps()
        tokens, outcome = drain(triedec.engine.batch.run_alone(lm.adapter, run))
        assert tokens == answer[: k + 1]
        assert check_steps(tokens, outcome.stats, run.take_steps(), stop_inside=True) == 1
        assert outcome.stats.accepted_by_origin["oracle"] == k - (k // 5)


def test_beam_records_its_live_hypotheses(lm):
    tokens, outcome, steps = traced(lm, "beam", max_new_tokens=12, num_beams=3)
    assert [t for s in steps for t in s.tokens] == tokens == list(outcome.sequences[0].token_ids)
    assert all(o == MODEL for s in steps for o in s.origins)
    live = [s for s in steps if s.tree is not None]
    assert live and all(s.tree.size > 1 for s in live)
    for s in live:  # the best hypothesis is a root path of the live trie
        pairs = zip(s.accepted, s.accepted[1:], strict=False)
        assert s.accepted[0] == 0 and all(s.tree.parents[b] == a for a, b in pairs)


def test_a_plain_run_records_nothing(lm):
    run = lm.start(GenerationRequest(REPEATING, "auto", max_new_tokens=8))
    drain(triedec.engine.batch.run_alone(lm.adapter, run, lm.cost_model(), lm.limits))
    assert run.take_steps() == []


def test_draft_sources_are_validated_and_follow_cuts():
    tree = TokenTree((5, 6, 7, 8), (-1, 0, 1, 0))
    draft = Draft.scored(tree, [1.0, 0.9, 0.5, 0.4], sources=[(), ("store", "context"), ("context",), ("recycling",)])
    assert draft.sources_of(0) == () and draft.sources_of(1) == ("store", "context")
    cut, kept = draft.within(3, 1)  # depth 1 only: node 2 goes
    assert kept == (0, 1, 3) and cut.sources == ((), ("store", "context"), ("recycling",))
    assert Draft.fixed(tree).sources_of(2) == (UNNAMED,)
    assert Draft.fixed(tree).labelled("lookahead").sources_of(3) == ("lookahead",)
    with pytest.raises(TriedecError, match="source lists"):
        Draft.scored(tree, [1.0, 0.9, 0.5, 0.4], sources=[(), ("context",)])
    with pytest.raises(TriedecError, match="source lists"):
        Draft.scored(tree, [1.0, 0.9, 0.5, 0.4], sources=[("context",)] * 4)
    with pytest.raises(TriedecError, match="origins"):
        StepTrace(1, (1, 2), (MODEL,))
    with pytest.raises(TriedecError, match="path from the root"):
        StepTrace(1, (1,), (MODEL,), tree, ((),) * 4, (0, 2))


def sse(url, body):
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_the_server_streams_each_step_only_when_asked(lm):
    body = {"messages": [{"role": "user", "content": REPEATING}], "max_tokens": 30, "method": "ngram-trie"}
    with serving(create_app(lm, ServerConfig(model_name="tiny"))) as url:
        plain = sse(url, body)
        assert all("trace" not in (c.get("triedec") or {}) for c in plain)
        assert "accepted_by_origin" not in plain[-1]["triedec"]
        chunks = sse(url, {**body, "trace": True})
        whole = httpx.post(url + "/v1/chat/completions", json={**body, "trace": True}, timeout=60).json()
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"] == \
        "".join(c["choices"][0]["delta"].get("content") or "" for c in plain if c["choices"])
    steps = [s for c in chunks for s in (c.get("triedec") or {}).get("trace", [])]
    final = chunks[-1]["triedec"]
    counts = Counter(o for s in steps for o in s["origins"])
    assert dict(counts) == final["accepted_by_origin"] and sum(counts.values()) == final["new_tokens"]
    assert [len(s["tokens"]) for s in steps[1:]] == final["accepted_per_step"]
    # the same tokens streamed or not (the trees may differ: the drafter learned from the first request)
    assert [t for s in steps for t in s["tokens"]] == [t for s in whole["triedec"]["trace"] for t in s["tokens"]]
    for s in steps:
        assert len(s["text"]) == len(s["tokens"])
        if "tree" in s:
            assert len(s["tree"]["texts"]) == len(s["tree"]["tokens"]) == len(s["tree"]["sources"])
