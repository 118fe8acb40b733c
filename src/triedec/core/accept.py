"""Acceptance rules: which part of a verified draft tree the target model agrees with.

One walk (:func:`walk`) serves every rule: from the root, ask the rule which token the target
model emits after the current node; if a child carries that token, accept it and descend; if none
does, that token is the step's last (the bonus token). The rules differ only in how the token
after a node is chosen:

* :class:`GreedyRule` -- the argmax of the node's logits (after the logit bias and penalties, if any);
* :class:`SamplingRule` -- a draw from the node's processed distribution
  (:func:`triedec.core.sampling.process`) with the uniform number of the node's output position
  (:func:`triedec.core.sampling.uniform`). For point-mass (model-free) drafts this is the recursive
  rejection rule of multi-draft speculative sampling (SpecInfer; EAGLE's tree sampling): each
  emitted token is exactly distributed as plain sampling's, for any tree, and greedy is its limit.

Both process each node with that node's own prefix: the committed context plus the node's
ancestors (never its siblings' tokens). :func:`acceptance_rule` picks the rule for a
:class:`~triedec.core.sampling.Sampling`; the engine calls ``rule.accept`` and never asks which it has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from triedec.core.errors import TriedecError
from triedec.core.rowops import argmax
from triedec.core.sampling import GREEDY_SAMPLING, Sampling, adjust, draw, process, seen_tokens, uniform
from triedec.core.tree import TokenTree


@dataclass(frozen=True)
class Acceptance:
    """The outcome of verifying one tree.

    ``path`` holds node indices from the root (``path[0] == 0``) to the deepest accepted draft node.
    ``tokens`` are the new tokens it yields: the accepted drafts, then the bonus token that the model
    chose after the last accepted node. ``len(tokens) == len(path)``.
    """

    path: tuple[int, ...]
    tokens: tuple[int, ...]


def walk(tree: TokenTree, choose: Callable[[int], int]) -> Acceptance:
    """Accept the longest root path along which every draft token is the token ``choose(parent)``
    that the target emits after its parent, plus the bonus token ``choose(last accepted node)``.

    ``choose(i)`` is asked only for nodes the walk reaches. In a trie the accepted path is unique. A
    tree may repeat a token among siblings (lookahead's independent branches); then every matching
    branch is followed and the longest accepted path wins (the first one on ties).
    """
    kids = tree.child_lists
    best: tuple[int, ...] = (0,)
    stack: list[tuple[int, ...]] = [(0,)]
    while stack:
        path = stack.pop()
        if len(path) > len(best):
            best = path
        want = choose(path[-1])
        stack += [(*path, c) for c in reversed(kids[path[-1]]) if tree.tokens[c] == want]
    return Acceptance(best, (*tuple(tree.tokens[i] for i in best[1:]), choose(best[-1])))


def accept_greedy(tree: TokenTree, argmax: Sequence[int]) -> Acceptance:
    """Greedy acceptance given ``argmax[i]``, the model's greedy next token after node i (length
    ``tree.size``): every accepted token is the argmax after its predecessor, so the tokens are
    exactly greedy decoding's."""
    return walk(tree, lambda i: int(argmax[i]))


class AcceptanceRule(Protocol):
    """Accepts part of a verified tree. ``logits [tree.size, vocab]`` are the model's next-token
    logits after every node; ``context`` is every committed token (prompt + output so far, ending
    with the tree's root); ``position`` is the output index of the first token this step emits (the
    token after the root). Pure: mutates nothing. ``seed`` is the sampling seed (None: greedy)."""

    seed: int | None

    @property
    def penalized(self) -> bool:
        """Whether :meth:`processed` reads the tokens of the row's prefix (a penalty applies)."""
        ...

    def accept(self, tree: TokenTree, logits: torch.Tensor, context: Sequence[int], position: int) -> Acceptance: ...

    def processed(self, row: torch.Tensor, seen: torch.Tensor, position: int) -> torch.Tensor:
        """The logits the rule chooses from after a row ``[V]`` whose prefix holds the token ids
        ``seen`` (needed only when :attr:`penalized`), ``position`` of them output so far."""
        ...

    def choose(self, row: torch.Tensor, seen: torch.Tensor, position: int) -> int:
        """The token the rule emits after a row ``[V]`` (``seen`` and ``position`` as for
        :meth:`processed`): what :meth:`accept` chooses after each node it reaches."""
        ...


class NodeRows:
    """What each reached node needs: its row of logits on the CPU, its output position, and,
    when a penalty applies (``penalized``), the token ids of its own prefix (context + its
    ancestors' drafts); without one, no prefix is built (an empty one penalizes nothing)."""

    def __init__(self, tree: TokenTree, logits: torch.Tensor, context: Sequence[int], position: int,
                 penalized: bool) -> None:
        self.tree, self.logits, self.context, self.penalized = tree, logits, context, penalized
        self.depths = tree.depths
        self.first = position

    def row(self, node: int) -> torch.Tensor:
        return self.logits[node].detach().to("cpu")

    def position(self, node: int) -> int:
        """The output index of the token chosen after ``node``."""
        return self.first + self.depths[node]

    def path(self, node: int) -> list[int]:
        """The draft tokens from the root's child down to ``node`` (empty for the root)."""
        tokens, parents = self.tree.tokens, self.tree.parents
        out: list[int] = []
        while node > 0:
            out.append(tokens[node])
            node = parents[node]
        return out[::-1]

    def seen(self, node: int) -> torch.Tensor:
        if not self.penalized:
            return seen_tokens(())
        return seen_tokens(self.context, self.path(node))  # the root is context[-1]


def memo(choose: Callable[[int], int]) -> Callable[[int], int]:
    chosen: dict[int, int] = {}

    def once(node: int) -> int:
        if node not in chosen:
            chosen[node] = choose(node)
        return chosen[node]

    return once


class _PerNode:
    """What the rules share: a penalty reads the prefix, and accepting by walking the tree with
    :meth:`choose` (each reached node's choice made once) on the node's own row, prefix and
    position."""

    sampling: Sampling

    @property
    def penalized(self) -> bool:
        return self.sampling.reads_prefix

    def choose(self, row: torch.Tensor, seen: torch.Tensor, position: int) -> int:
        raise NotImplementedError

    def walk_nodes(self, tree: TokenTree, logits: torch.Tensor, context: Sequence[int], position: int) -> Acceptance:
        nodes = NodeRows(tree, logits, context, position, self.penalized)
        return walk(tree, memo(lambda i: self.choose(nodes.row(i), nodes.seen(i), nodes.position(i))))


@dataclass(frozen=True)
class GreedyRule(_PerNode):
    """Greedy decoding: after each node, the argmax of its logits, changed first as ``sampling``
    says (:func:`~triedec.core.sampling.adjust`: logit bias, ``min_tokens`` holding back the ids
    ``suppress``, the penalties over the node's own prefix); temperature and the top-k/p and min-p
    filters never change the argmax."""

    sampling: Sampling = GREEDY_SAMPLING
    suppress: tuple[int, ...] = ()
    seed: None = None

    def processed(self, row: torch.Tensor, seen: torch.Tensor, position: int) -> torch.Tensor:
        return adjust(row, seen, self.sampling, position, self.suppress)

    def accept(self, tree: TokenTree, logits: torch.Tensor, context: Sequence[int], position: int) -> Acceptance:
        if not self.sampling.adjusts_from(position):
            return accept_greedy(tree, argmax(logits))
        return self.walk_nodes(tree, logits, context, position)

    def choose(self, row: torch.Tensor, seen: torch.Tensor, position: int) -> int:
        return int(self.processed(row, seen, position).argmax())


@dataclass(frozen=True)
class SamplingRule(_PerNode):
    """Sampling: after node i, the token drawn from its processed distribution with the uniform
    number of output position ``position + depth(i)``, keyed by ``seed`` (``suppress``: the ids
    ``min_tokens`` holds back)."""

    sampling: Sampling
    seed: int
    suppress: tuple[int, ...] = ()

    def processed(self, row: torch.Tensor, seen: torch.Tensor, position: int) -> torch.Tensor:
        return process(row, seen, self.sampling, position, self.suppress)

    def accept(self, tree: TokenTree, logits: torch.Tensor, context: Sequence[int], position: int) -> Acceptance:
        return self.walk_nodes(tree, logits, context, position)

    def choose(self, row: torch.Tensor, seen: torch.Tensor, position: int) -> int:
        return draw(self.processed(row, seen, position), uniform(self.seed, position))


GREEDY = GreedyRule()
"""Plain greedy decoding."""


def acceptance_rule(sampling: Sampling, suppress: Iterable[int] = ()) -> AcceptanceRule:
    """The rule for ``sampling``: :class:`GreedyRule` at temperature 0, else :class:`SamplingRule`
    (which needs ``sampling.seed`` set). ``suppress``: the end-of-sequence and stop ids that get
    no mass before ``sampling.min_tokens`` tokens are out."""
    held = tuple(sorted(set(suppress))) if sampling.min_tokens else ()
    if sampling.greedy:
        return GreedyRule(sampling, held)
    if sampling.seed is None:
        raise TriedecError("sampling needs a seed (the API draws one when none is given)")
    return SamplingRule(sampling, sampling.seed, held)
