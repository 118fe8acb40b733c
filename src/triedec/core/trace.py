"""Where each token came from: one record per decoding step, for whoever asked to see them.

A run that records its steps (:meth:`~triedec.engine.request.Request.record_steps`) appends one
:class:`StepTrace` per forward that committed tokens: the prefill's first token (step 0), then
each propose -> verify -> accept -> commit step. A step's record holds the tokens it committed,
each with its *origin*, and the tree it verified with the accepted path:

* a token the forward itself chose (the step's last token, the bonus token, and the prefill's
  first) has origin :data:`MODEL`;
* a draft token the model accepted has the origin of the node that proposed it: the first of the
  draft's :attr:`~triedec.drafters.base.Draft.sources` for that node (``context``, ``prompt``,
  ``recycling``, ``store``, ``lookahead``; see :data:`~triedec.drafters.base.SOURCES`).

Beam search records its live hypotheses as the step's tree (the best one as the accepted path)
and the tokens that became certain, all of origin :data:`MODEL`.

The same accounting fills :attr:`~triedec.engine.outcome.Stats.accepted_by_origin`, so the counts of
a request's recorded origins equal its stats. Pure values; JSON through :meth:`StepTrace.as_json`
(the server's stream extension, ``docs/playground.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from triedec.core.errors import TriedecError
from triedec.core.tree import TokenTree

MODEL = "model"
"""The origin of a token the model's forward chose itself (nothing drafted it)."""


@dataclass(frozen=True)
class StepTrace:
    """One step's record.

    ``step``: 0 for the token the prefill chose, then 1, 2, ... per verification step (beam: per
    beam step). ``tokens``: what the step committed, in order (after a stop rule's cut);
    ``origins[i]``: token i's origin (:data:`MODEL` or a draft source). ``tree``: the verified tree
    (None for step 0); ``tree_sources[n]``: the sources that drafted node n (the root's empty);
    ``accepted``: node indices from the root along the accepted path (beam: along the best live
    hypothesis); ``pruned``: the drafter's nodes the request's grammar cut before the forward
    (forbidden there, with their subtrees).
    """

    step: int
    tokens: tuple[int, ...]
    origins: tuple[str, ...]
    tree: TokenTree | None = None
    tree_sources: tuple[tuple[str, ...], ...] = ()
    accepted: tuple[int, ...] = ()
    pruned: int = 0

    def __post_init__(self) -> None:
        if len(self.origins) != len(self.tokens):
            raise TriedecError(f"a step of {len(self.tokens)} tokens needs {len(self.tokens)} origins")
        if self.tree is not None:
            if len(self.tree_sources) != self.tree.size:
                raise TriedecError("tree_sources must name every node's sources")
            if self.accepted and (self.accepted[0] != 0 or any(
                    self.tree.parents[b] != a for a, b in zip(self.accepted, self.accepted[1:], strict=False))):
                raise TriedecError("accepted must be a path from the root")

    def as_json(self) -> dict[str, Any]:
        """The record as JSON values (the server's ``triedec.core.trace`` entries)."""
        out: dict[str, Any] = {"step": self.step, "tokens": list(self.tokens), "origins": list(self.origins)}
        if self.tree is not None:
            out["tree"] = {"tokens": list(self.tree.tokens), "parents": list(self.tree.parents),
                           "sources": [list(s) for s in self.tree_sources], "accepted": list(self.accepted),
                           "pruned": self.pruned}
        return out


def origin_of(sources: tuple[str, ...]) -> str:
    """A draft node's origin: its first source (:data:`MODEL` for the root, which nothing drafted)."""
    return sources[0] if sources else MODEL
