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

    ``argmax[i]`` is the model's greedy next token after node i (length ``tree.size``). Because the
    tree is a trie (no two siblings share a token) the accepted path is unique, and its tokens are
    exactly what greedy autoregressive decoding would produce.
    """
    path = [0]
    node = 0
    while True:
        nxt = tree.children[node].get(int(argmax[node]))
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    tokens = (*tuple(tree.tokens[i] for i in path[1:]), int(argmax[node]))
    return Acceptance(tuple(path), tokens)
