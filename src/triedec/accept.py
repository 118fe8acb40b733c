"""Acceptance rules: which part of a verified draft tree the target model agrees with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from triedec.tree import TokenTree


@dataclass(frozen=True)
class Acceptance:
    """The outcome of verifying one tree.

    ``path`` holds node indices from the root (``path[0] == 0``) to the deepest accepted draft node.
    ``tokens`` are the new tokens it yields: the accepted drafts, then the bonus token that the model
    predicted after the last accepted node. ``len(tokens) == len(path)``.
    """

    path: tuple[int, ...]
    tokens: tuple[int, ...]


def accept_greedy(tree: TokenTree, argmax: Sequence[int]) -> Acceptance:
    """Greedy acceptance: the longest root-to-leaf path whose every draft token equals the argmax
    of its parent's logits, plus the bonus token.

    ``argmax[i]`` is the model's greedy next token after node i (length ``tree.size``). In a trie
    (no two siblings share a token) the accepted path is unique. A tree may repeat a token among
    siblings (lookahead's independent branches); then every matching branch is followed and the
    longest accepted path wins (the first one on ties). Every accepted token is the argmax after
    its predecessor, so the tokens are exactly greedy decoding's.
    """
    kids = tree.child_lists
    best: tuple[int, ...] = (0,)
    stack: list[tuple[int, ...]] = [(0,)]
    while stack:
        path = stack.pop()
        if len(path) > len(best):
            best = path
        want = int(argmax[path[-1]])
        stack += [(*path, c) for c in reversed(kids[path[-1]]) if tree.tokens[c] == want]
    tokens = (*tuple(tree.tokens[i] for i in best[1:]), int(argmax[best[-1]]))
    return Acceptance(best, tokens)
