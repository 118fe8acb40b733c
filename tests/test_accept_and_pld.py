import pytest

from triedec.core.accept import accept_greedy
from triedec.core.errors import TriedecError
from triedec.core.tree import TokenTree
from triedec.drafters.prompt_lookup import PromptLookupOptions, find_matches


def continuations(context, options):
    return [cont for _, cont in find_matches(context, options)]


def test_greedy_acceptance_follows_argmax_and_adds_bonus():
    tree = TokenTree.from_sequences(9, [[1, 2, 3], [1, 4], [5]])
    # nodes: 0:9 1:1 2:2 3:3 4:4 5:5 ; argmax after each node
    argmax = [1, 4, 0, 0, 8, 0]
    acc = accept_greedy(tree, argmax)
    assert acc.path == (0, 1, 4)
    assert acc.tokens == (1, 4, 8)


def test_greedy_acceptance_rejects_everything():
    tree = TokenTree.from_sequences(9, [[1, 2]])
    acc = accept_greedy(tree, [7, 2, 3])
    assert acc.path == (0,)
    assert acc.tokens == (7,)


def test_prompt_lookup_longest_ngram_first_and_most_recent_first():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    ctx = [1, 2, 3, 9, 9, 5, 2, 3, 8, 7, 2, 3]
    opts = PromptLookupOptions(max_ngram=3, min_ngram=1, num_tokens=2, num_matches=3)
    # suffix 3-gram (7,2,3) absent; 2-gram (2,3) at 1 and 6 -> most recent first
    assert continuations(ctx, opts) == [(8, 7), (9, 9)]
    opts1 = PromptLookupOptions(max_ngram=1, min_ngram=1, num_tokens=3, num_matches=5)
    assert continuations(ctx, opts1) == [(8, 7, 2), (9, 9, 5)]


def test_prompt_lookup_no_match_and_short_context():
    opts = PromptLookupOptions()
    assert continuations([1, 2, 3, 4], opts) == []
    assert continuations([5], opts) == []


def test_prompt_lookup_deduplicates_continuations():
    ctx = [4, 1, 4, 1, 4]
    opts = PromptLookupOptions(max_ngram=2, min_ngram=1, num_tokens=2, num_matches=4)
    assert continuations(ctx, opts) == [(1, 4)]


@pytest.mark.parametrize(
    "kwargs", [dict(max_ngram=0), dict(num_tokens=-1), dict(num_matches=0), dict(min_ngram=4, max_ngram=3),
               dict(num_tokens=1.5), dict(max_ngram=True),
               dict(min_expected=-1.0), dict(min_expected=float("nan")), dict(min_expected="1")]
)
def test_prompt_lookup_bad_options(kwargs):
    with pytest.raises(TriedecError):
        PromptLookupOptions(**kwargs)
