"""A request's grammar applied to its drafts: branches the grammar forbids are cut before the
forward, the tokens it forces are drafted as a chain in front, and the drafter sees only its own
nodes of what was verified.

The rows the model computes and the tokens accepted do not depend on any of this: every node's
choice is masked by the grammar after its own prefix (:class:`~triedec.core.grammar.ConstrainedRule`),
so a cut branch could never have been accepted and a forced token is accepted exactly when ``ar``
would emit it. What changes is how many tokens a forward yields.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from triedec.core.accept import Acceptance
from triedec.core.grammar import FORCED, TokenConstraint
from triedec.core.tree import TokenTree
from triedec.drafters.base import Draft, Verified

EXTENDED_LEAVES = 4
"""How many of a draft's leaves (best first) get the tokens the grammar forces after them."""


def constrained_draft(draft: Draft, constraint: TokenConstraint, forced: Sequence[int] = (),
                      extend: int = 0, limit: int = 0) -> tuple[Draft, tuple[int, ...]]:
    """``draft`` under the grammar: ``forced`` (the tokens the grammar forces after the root) as
    a chain in front (chance 1, source :data:`~triedec.core.grammar.FORCED`), then every draft
    node the grammar admits after its own path, merged into the chain where it repeats it; a node
    the grammar forbids goes with its subtree. The first ``extend`` leaves the drafter drafted
    (best first) are then followed by the tokens the grammar forces after them (at most
    ``limit``), each right after its leaf with the leaf's chance: a forced token is accepted
    exactly when its parent is. Returns the new draft (best first: the chain, then the drafter's
    nodes in its order) and, for each of its nodes, its index in ``draft`` (-1 for a node only the
    grammar drafted)."""
    tree = draft.tree
    tokens, parents, chances = [tree.root], [-1], [1.0]
    sources: list[tuple[str, ...]] = [()]
    own: list[int] = [0]
    paths: list[list[int]] = [[]]
    child: dict[tuple[int, int], int] = {}
    for t in forced:
        node = len(tokens)
        child[(node - 1, t)] = node
        tokens.append(t)
        parents.append(node - 1)
        chances.append(1.0)
        sources.append((FORCED,))
        own.append(-1)
        paths.append([*paths[-1], t])
    where: dict[int, int] = {0: 0}  # draft node -> new node
    made = 0  # draft nodes that became new nodes among the draft's required ones
    for i in range(1, tree.size):
        parent = where.get(tree.parents[i])
        if parent is None:
            continue  # its parent was cut
        tok = tree.tokens[i]
        node = child.get((parent, tok))
        if node is not None:  # the forced chain already holds it
            own[node] = i
            sources[node] = (FORCED, *(s for s in draft.sources_of(i) if s != FORCED))
            where[i] = node
            continue
        if not constraint.admits(paths[parent], tok):
            continue
        node = len(tokens)
        child[(parent, tok)] = node
        tokens.append(tok)
        parents.append(parent)
        chances.append(draft.chances[i])
        sources.append(draft.sources_of(i))
        own.append(i)
        paths.append([*paths[parent], tok])
        where[i] = node
        made += i < draft.required
    required = len(tokens) if draft.whole else 1 + len(forced) + made
    chains = _leaf_chains(constraint, parents, own, paths, extend, limit)
    if len(tokens) == tree.size and not forced and not chains:
        return draft, tuple(range(tree.size))
    if chains:  # each chain right after its leaf: renumber the nodes
        at: list[int] = []
        out_tokens: list[int] = []
        out_parents: list[int] = []
        out_chances: list[float] = []
        out_sources: list[tuple[str, ...]] = []
        out_own: list[int] = []
        grown = 0
        for i in range(len(tokens)):
            at.append(len(out_tokens))
            out_tokens.append(tokens[i])
            out_parents.append(-1 if i == 0 else at[parents[i]])
            out_chances.append(chances[i])
            out_sources.append(sources[i])
            out_own.append(own[i])
            for t in chains.get(i, ()):
                out_parents.append(len(out_tokens) - 1)
                out_tokens.append(t)
                out_chances.append(chances[i])
                out_sources.append((FORCED,))
                out_own.append(-1)
                grown += i < required
        tokens, parents, chances, sources, own = out_tokens, out_parents, out_chances, out_sources, out_own
        required = len(tokens) if draft.whole else required + grown
    new = Draft(TokenTree(tuple(tokens), tuple(parents)), tuple(chances), max(1, min(required, len(tokens))),
                tuple(sources))
    return new, tuple(own)


def _leaf_chains(constraint: TokenConstraint, parents: Sequence[int], own: Sequence[int],
                 paths: Sequence[Sequence[int]], extend: int, limit: int) -> dict[int, list[int]]:
    """The tokens the grammar forces after each of the first ``extend`` leaves the drafter
    drafted (``own >= 0``), by leaf; leaves with none left out."""
    if extend <= 0 or limit <= 0:
        return {}
    inner = set(parents[1:])
    chains: dict[int, list[int]] = {}
    for node in range(1, len(parents)):
        if node in inner or own[node] < 0:
            continue
        if (chain := constraint.forced(limit, paths[node])):
            chains[node] = chain
        extend -= 1
        if extend == 0:
            break
    return chains


def own_view(tree: TokenTree, logits: torch.Tensor, acceptance: Acceptance, kept: Sequence[int],
             proposed: int) -> Verified:
    """What the drafter is shown of a verified tree whose nodes with ``kept[i] == -1`` only the
    grammar drafted: its own nodes (a subtree: a drafter node's parent is the drafter's too), their
    rows, and the accepted path as far as it runs through them, each with the token chosen after
    it. ``kept[i]``: verified node i's index in the drafter's proposal."""
    nodes = [i for i in range(tree.size) if kept[i] >= 0]
    if len(nodes) == tree.size:
        return Verified(tree, logits, acceptance, tuple(kept), proposed)
    index = {old: new for new, old in enumerate(nodes)}
    sub = TokenTree(tuple(tree.tokens[i] for i in nodes),
                    tuple(-1 if i == 0 else index[tree.parents[i]] for i in nodes))
    depth = 0
    while depth < len(acceptance.path) and acceptance.path[depth] in index:
        depth += 1
    path = tuple(index[i] for i in acceptance.path[:depth])
    return Verified(sub, logits[nodes], Acceptance(path, acceptance.tokens[:depth]), tuple(kept[i] for i in nodes),
                    proposed)
