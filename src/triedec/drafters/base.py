"""The drafter protocol: drafts, what the model verified, per-request sessions and the base class
every drafter extends (the registry that finds them by name is :mod:`triedec.drafters.registry`).

A drafter is model-free: it sees token ids (the context) and, after each verification, what the
model computed for the tree it proposed. The engine treats every drafter alike.

**Where state lives.** A drafter object is shared by every request that uses its method and
options (the :class:`~triedec.api.lm.LM` keeps one, so learned state stays warm); everything that
belongs to one request lives in the :class:`DrafterSession` that ``drafter.begin(...)`` returns.
State meant to outlive requests (Token Recycling's matrix, agreement rates) stays on the drafter,
and every update of it is made under the drafter's lock, so concurrent requests are safe.

Every drafter extends :class:`BaseDrafter` (defaults for what it does not learn or keep) and is
registered with one decorator (:func:`triedec.drafters.registry.register`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from triedec.core.accept import Acceptance
from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError
from triedec.core.tree import TokenTree
from triedec.drafters.learned import Learned


@dataclass(frozen=True)
class ModelInfo:
    """What a drafter may know about the target model: nothing about its internals.

    ``model_id`` fingerprints the weights (to tag saved drafter state). ``cost`` is the device's
    measured cost curve, or None: size drafts as for a flat curve (every verified token free).
    ``profiles`` holds calibrated, method-specific values by method name (Token Recycling's node
    acceptance rates under ``"recycling"``). Both are measured by :mod:`triedec.api.calibration`
    before a drafter is built, never by the drafter.
    """

    vocab_size: int
    device: torch.device
    model_id: str = ""
    cost: CostModel | None = None
    profiles: Mapping[str, Any] = field(default_factory=dict, compare=False)


FROM_STORE = "tokens_from_store"
"""Key of a session's :meth:`~DrafterSession.stats`: this request's accepted draft tokens that a
store of earlier requests' outputs proposed (auto's store); drafters without one report nothing
(read as 0). The server returns it, so that whether learned state crossed requests is visible."""

MAX_TREE_NODES = 256
"""Upper bound on a verified tree's size (root included); the engine cuts larger proposals."""

SOURCES = {
    "context": "an n-gram trie over the request's own context (documents, prompt, output so far)",
    "prompt": "prompt lookup: a continuation of an earlier occurrence of the last tokens in the context",
    "recycling": "Token Recycling's adjacency matrix: the model's own earlier top-k after a token",
    "store": "auto's cross-request store: earlier outputs of this model",
    "lookahead": "lookahead decoding's n-gram pool and Jacobi window",
    "grammar": "the request's grammar: the only token it allows there (drafted for free, always accepted)",
}
"""The draft sources the built-in drafters name in :attr:`Draft.sources`, with what each is (the
playground's legend and ``docs/`` show these). A plug-in drafter may name others."""

UNNAMED = "draft"
"""The source of a draft node whose drafter named none."""


@dataclass(frozen=True)
class Draft:
    """A proposal: a tree and each node's estimated chance of being accepted, best first.

    ``tree`` lists its nodes best first (any prefix of a tree's node list is a tree, so the engine
    can verify any prefix). ``chances[i]`` is the drafter's estimate of the probability that node
    i is accepted (the root's is 1); the allocator (:mod:`triedec.core.allocate`) merges every running
    request's chances and decides how long a prefix of each draft one forward verifies.
    ``required``: how many leading nodes (root included) are verified whatever the allocator
    decides. "Verify the whole tree" is spelled ``required == tree.size`` (:attr:`whole`; built
    with ``Draft.scored(..., whole=True)`` or :meth:`fixed`): drafters with a fixed tree
    (lookahead) and those whose user forced a size (auto's and ngram-trie's ``sized=false``, pld's
    ``min_expected``, recycling's ``nodes=N``) draft that way. ``sources[i]``: the names of the sources that drafted
    node i, primary first (see :data:`SOURCES`; the root's is empty), or ``()`` when the drafter
    names none (its nodes count as :data:`UNNAMED`): what a token accepted from node i reports as
    its origin (:mod:`triedec.core.trace`). Frozen and validated on construction."""

    tree: TokenTree
    chances: tuple[float, ...]
    required: int = 1
    sources: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        chances = tuple(float(c) for c in self.chances)
        object.__setattr__(self, "chances", chances)
        if len(chances) != self.tree.size:
            raise TriedecError(f"a draft of {self.tree.size} nodes needs {self.tree.size} chances, got {len(chances)}")
        if chances[0] != 1.0 or any(not 0.0 <= c <= 1.0 for c in chances):
            raise TriedecError("draft chances must lie in [0, 1], the root's being 1")
        if isinstance(self.required, bool) or not isinstance(self.required, int) \
                or not 1 <= self.required <= self.tree.size:
            raise TriedecError(f"required must be an integer in [1, {self.tree.size}], got {self.required!r}")
        sources = tuple(tuple(str(n) for n in names) for names in self.sources)
        object.__setattr__(self, "sources", sources)
        if sources and (len(sources) != self.tree.size or sources[0]):
            raise TriedecError(f"a draft of {self.tree.size} nodes needs {self.tree.size} source lists (the root's "
                               f"empty), got {len(sources)}")

    def labelled(self, source: str) -> Draft:
        """This draft with every draft node drafted by ``source`` (a drafter with one source)."""
        return dataclasses.replace(self, sources=((),) + ((source,),) * (self.size - 1))

    def sources_of(self, node: int) -> tuple[str, ...]:
        """Who drafted ``node``: its sources, :data:`UNNAMED` if the drafter named none, ``()`` for
        the root."""
        if node == 0:
            return ()
        return self.sources[node] if self.sources else (UNNAMED,)

    @classmethod
    def root_only(cls, root: int) -> Draft:
        """Nothing drafted: verifying it is one plain step."""
        return cls(TokenTree.root_only(root), (1.0,))

    @property
    def whole(self) -> bool:
        """Whether the whole tree is verified whatever the allocator decides."""
        return self.required == self.tree.size

    @classmethod
    def fixed(cls, tree: TokenTree) -> Draft:
        """A tree verified whole, without estimates (its drafts count as chance 0 when sizing the
        rest of the forward)."""
        return cls(tree, (1.0,) + (0.0,) * (tree.size - 1), tree.size)

    @classmethod
    def scored(cls, tree: TokenTree, chances: Sequence[float], whole: bool = False,
               sources: Sequence[Sequence[str]] = ()) -> Draft:
        """A tree with estimates; ``whole``: the whole tree is verified (every node required: the
        user forced a size)."""
        return cls(tree, tuple(chances), tree.size if whole else 1, tuple(tuple(s) for s in sources))

    @property
    def size(self) -> int:
        return self.tree.size

    def within(self, max_nodes: int, max_depth: int) -> tuple[Draft, tuple[int, ...]]:
        """This draft without its nodes deeper than ``max_depth`` and cut to ``max_nodes`` nodes:
        a smaller draft (still best first) and, for each of its nodes, its index here."""
        depths = self.tree.depths
        keep = [i for i in range(self.size) if depths[i] <= max_depth][:max_nodes]
        if len(keep) == self.size:
            return self, tuple(keep)
        index = {old: new for new, old in enumerate(keep)}
        parents = tuple(-1 if i == 0 else index[self.tree.parents[i]] for i in keep)
        tree = TokenTree(tuple(self.tree.tokens[i] for i in keep), parents)
        required = sum(1 for i in keep if i < self.required)
        sources = tuple(self.sources[i] for i in keep) if self.sources else ()
        return Draft(tree, tuple(self.chances[i] for i in keep), max(1, required), sources), tuple(keep)


@dataclass(frozen=True)
class Verified:
    """What the model computed for a proposal.

    ``tree``: the nodes that were verified, which may be fewer than proposed: the engine keeps a
    prefix of the draft that the allocator sized (and drops nodes past ``max_new_tokens``).
    ``kept[i]`` is the proposal index of verified node i; ``proposed`` is the proposal's size
    (None for both: the whole proposal was verified). ``logits``: float ``[tree.size, vocab]``,
    the model's next-token logits after every verified node (root and every draft node, accepted
    or not). ``acceptance``: the accepted path and new tokens.
    """

    tree: TokenTree
    logits: torch.Tensor
    acceptance: Acceptance
    kept: tuple[int, ...] | None = None
    proposed: int | None = None

    @property
    def cut(self) -> bool:
        """Whether fewer nodes were verified than proposed."""
        return self.proposed is not None and self.tree.size < self.proposed

    def index(self, node: int) -> int:
        """The proposal index of verified node ``node``."""
        return node if self.kept is None else self.kept[node]


@runtime_checkable
class DrafterSession(Protocol):
    """One request's drafting state. The engine calls, in this order:

    * if the drafter's ``prefill_logits`` > 0: ``observe`` with the prompt's last
      ``prefill_logits`` tokens as verified chains with their prefill logits, one per prompt chunk
      that holds some of them, in order;
    * per step, ``propose(context, max_nodes)`` -- a :class:`Draft` of at most ``max_nodes`` nodes
      rooted at ``context[-1]`` (context = prompt + generated), best first; ``max_nodes`` is 1 on
      a step whose drafting a server batch skips (:class:`~triedec.core.allocate.DraftGate`), where
      the root alone is the answer and the cheaper the better -- then
      ``observe(verified)`` -- what the model computed for the part of it that was verified
      (:class:`Verified` says which part);
    * ``end()`` -- the request is over (also when the caller stops early or the request is
      cancelled);

    and ``stats()`` for counters to report. A session is used by one request (one thread) only.
    """

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft: ...

    def observe(self, verified: Verified) -> None: ...

    def end(self) -> None: ...

    def stats(self) -> dict[str, float]: ...


@runtime_checkable
class Drafter(Protocol):
    """Model-free draft proposer shared by many requests: ``begin(prompt, documents)`` starts one
    request and returns its :class:`DrafterSession`; ``prefill_logits`` says how many of the
    prompt's last positions the session wants to observe with their prefill logits; ``persist()``
    writes the learned state to its file, if one is configured (a snapshot taken under the
    drafter's lock, written outside it; the engine decides when). ``export_learned()`` returns
    what it learned here since its last export and ``absorb_learned(learned)`` merges another
    replica's (:mod:`triedec.drafters.learned`: what is exchanged and each part's merge rule);
    a drafter that learns nothing across requests exports an empty value and absorbs nothing.
    ``max_learned_bytes()``: the most memory its learned state can ever take, from its options'
    bounds (not what it holds now): what :mod:`triedec.api.decoders` keeps built methods under.
    ``drafts_forced``: whether the engine drafts the tokens a request's grammar forces in front of
    the drafter's proposal (every drafter but ``ar``, the one-token-a-forward reference)."""

    prefill_logits: int
    drafts_forced: bool

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> DrafterSession: ...

    def persist(self) -> None: ...

    def export_learned(self) -> Learned: ...

    def absorb_learned(self, learned: Learned) -> None: ...

    def max_learned_bytes(self) -> int: ...


class BaseSession:
    """No-op defaults for the optional parts of :class:`DrafterSession`."""

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft:
        raise NotImplementedError

    def observe(self, verified: Verified) -> None:
        """Nothing to learn."""

    def end(self) -> None:
        """Nothing to flush."""

    def stats(self) -> dict[str, float]:
        return {}


class _StatelessSession(BaseSession):
    def __init__(self, propose: Callable[[Sequence[int]], TokenTree | Draft]) -> None:
        self._propose = propose

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft:
        found = self._propose(context)
        return found if isinstance(found, Draft) else Draft.fixed(found)


class BaseDrafter:
    """A drafter without per-request state: subclasses define ``propose(context)`` (a
    :class:`Draft`, or a plain tree to be verified whole) and ``begin`` returns a session that
    calls it. Drafters with per-request state override ``begin`` to return their own
    :class:`DrafterSession`."""

    prefill_logits: int = 0
    drafts_forced: bool = True

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> DrafterSession:
        return _StatelessSession(self.propose)

    def propose(self, context: Sequence[int]) -> TokenTree | Draft:
        raise NotImplementedError(f"{type(self).__name__} must define propose() or begin()")

    def persist(self) -> None:
        """No learned state to write."""

    def export_learned(self) -> Learned:
        """Nothing learned across requests."""
        return Learned()

    def absorb_learned(self, learned: Learned) -> None:
        """Nothing to merge."""

    def max_learned_bytes(self) -> int:
        """Nothing learned across requests."""
        return 0
