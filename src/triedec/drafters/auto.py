"""Method ``auto``: every drafting source merged into one device-sized trie, with a memory of past
answers.

Each step collects candidate continuations of the last token from three sources:

* ``context`` -- an :class:`~triedec.drafters.ngram_trie.NgramTrie` over this request's documents,
  prompt and output so far (the most frequent continuations of the longest matched suffix; a
  node's base chance is the share of its parent's occurrences that continue that way);
* ``store`` -- the :class:`OutputStore`, a bounded cross-request memory of earlier outputs of this
  loaded model, each after the end of its prompt: the continuations after the places where the
  context's last 3 or 8 tokens occurred, longest match first (base chance 1), so that a question
  asked again is drafted from its earlier answer from the first token;
* ``recycling`` -- Token Recycling's adjacency matrix (the model's own top-k after each token,
  from every verified position of the steps it drafts): ranks 0-3 after the root, 0-1 after
  those, 0 after the best (base chance 1).

Candidates are merged into one trie (a path proposed by several sources is one node). Each node
is scored by the measured acceptance of the *kinds* that proposed it: a kind is a source with its
detail (the context's matched suffix length, the store's match class, the recycling rank), and
acceptance is measured per (kind, depth, hot), where hot means the previous step accepted a draft:
two moving averages over tried nodes (those whose parent was accepted), of accepted and of base,
whose ratio is the rate, so that ``base * rate`` estimates a node's chance given its parent
whatever its base. Given its parent, a node's chance is ``1 - prod (1 - base * rate)`` over its
kinds (merged evidence); siblings whose chances add up to more than 1 are scaled down together
(at most one child is accepted); its chance to be accepted is that times its parent's. The draft
lists the nodes best first by that chance, and the engine's allocator (:mod:`triedec.core.allocate`)
verifies the prefix that pays under the device's cost model, shared with every other running
request: nothing where nothing pays. A key whose nodes were not verified drifts back toward its
prior, so it is tried again later. ``sized=False`` sends every ranked node.

**State.** Per request (the session): the context trie and the output so far. Shared (the
drafter, under its lock): the matrix, the rates, the store; the store receives each request's
output when the request ends and, with ``store=PATH``, is loaded at start (refused if it comes
from another model or is corrupt) and written atomically when the engine persists learned state
(:meth:`AutoDrafter.persist`: when it goes idle, every few finished requests, at shutdown).
:meth:`AutoDrafter.export_learned` / :meth:`~AutoDrafter.absorb_learned` exchange all three with
other processes (:mod:`triedec.drafters.learned`).
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from triedec.core.errors import TriedecError, positive_int
from triedec.core.settings import at_most
from triedec.core.tree import TokenTree
from triedec.drafters.base import FROM_STORE, MAX_TREE_NODES, BaseDrafter, BaseSession, Draft, ModelInfo, Verified
from triedec.drafters.learned import Learned
from triedec.drafters.matrix import AdjacencyMatrix
from triedec.drafters.rates import RateTable
from triedec.drafters.registry import NEEDS_COST, STATE_FILE, register
from triedec.drafters.state import check_location
from triedec.drafters.store import LONGEST_MATCH, STORE_BYTES_PER_TOKEN, OutputStore
from triedec.drafters.trie import NgramTrie, TrieStream

METHOD = "auto"
SOURCES = ("context", "store", "recycling")
ORIGIN_ORDER = ("store", "context", "recycling")
"""a node several sources proposed names them in this order in its draft's ``sources`` (the first
is the origin its accepted token reports: the store's, where it had one)"""
DEPTH_KEYS = 4
"""acceptance is measured per depth 1 .. DEPTH_KEYS - 1, and for all deeper nodes together"""
RECYCLING_RANKS = (4, 2, 1)
"""candidates taken from the matrix at depths 1, 2, 3 (the latter two under the best parent only)"""
SHARE_BACKLOG = 256
"""outputs finished here that wait for the next export at most (older ones are not exported)"""


@dataclass(frozen=True)
class AutoOptions:
    max_nodes: int = field(default=64, metadata=at_most(MAX_TREE_NODES))
    """most candidate nodes ranked per step (before sizing)"""
    depth: int = field(default=12, metadata=at_most(64))
    """deepest continuation taken from the context and the store"""
    n: int = field(default=13, metadata=at_most(64))
    """the context trie's window (as ngram-trie's n)"""
    store_capacity: int = field(default=200_000, metadata=at_most(1_000_000))
    """bound on the tokens the cross-request store keeps (oldest outputs evicted first)"""
    store: str = field(default="", metadata=STATE_FILE)
    """file the store is loaded from (if it exists) and written to when the engine persists learned state
    (when idle, every few finished requests, at shutdown)"""
    k: int = field(default=8, metadata=at_most(64))
    """candidates per row of the recycling matrix"""
    sized: bool = True
    """size each tree by the device's cost curve (False: send every ranked node)"""

    def __post_init__(self) -> None:
        for name in ("max_nodes", "depth", "store_capacity", "k"):
            positive_int(name, getattr(self, name))
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 2:
            raise TriedecError(f"n must be an integer >= 2, got {self.n!r}")
        if not isinstance(self.store, str):
            raise TriedecError(f"store must be a file path, got {self.store!r}")
        if not isinstance(self.sized, bool):
            raise TriedecError(f"sized must be true or false, got {self.sized!r}")


Kind = tuple[str, int]
"""(source, detail): the context's matched suffix length, the store's match class
(:func:`_match_class`), or the recycling candidate's rank in its row"""
Key = tuple[Kind, int, bool]
"""what acceptance is measured per: (kind, depth (capped at :data:`DEPTH_KEYS`), hot)"""


def _valid_key(key: object) -> bool:
    """A :data:`Key`: ((source, detail), depth, hot)."""
    return (isinstance(key, tuple) and len(key) == 3 and isinstance(key[0], tuple) and len(key[0]) == 2
            and key[0][0] in SOURCES and isinstance(key[0][1], int) and not isinstance(key[0][1], bool)
            and isinstance(key[1], int) and not isinstance(key[1], bool) and 0 <= key[1] <= DEPTH_KEYS
            and isinstance(key[2], bool))


@dataclass
class _Node:
    token: int
    parent: tuple[int, ...]
    base: dict[Kind, float]


def _match_class(length: int) -> int:
    """The store kind's detail: match lengths 3-7 apart, 8-15 together, and LONGEST_MATCH (the
    question's end and more, as when a question is asked again)."""
    return length if length < 8 else 8 if length < LONGEST_MATCH else LONGEST_MATCH


def _needs(options: AutoOptions) -> frozenset[str]:
    return frozenset({NEEDS_COST}) if options.sized else frozenset()


@register(METHOD, AutoOptions, "every source (context, a store of earlier outputs, the recycling matrix) merged "
          "into one trie, scored by measured acceptance and sized for the device", needs=_needs)
class AutoDrafter(BaseDrafter):
    """Shared across requests, under ``lock``: the recycling matrix, the acceptance rates per
    :data:`Key`, the output store and the per-source counters."""

    PRIOR: ClassVar[dict[str, float]] = {"context": 0.8, "store": 0.6, "recycling": 0.3}
    """initial acceptance rate of a tried node, per source"""
    EMA = 0.1
    """weight of a new tried node in the two moving averages behind a rate"""
    RELAX = 0.01
    """how far a skipped key's averages move back toward the prior per step it was skipped"""

    def __init__(self, options: AutoOptions, model: ModelInfo) -> None:
        self.options = options
        self.model_id, self.vocab_size = model.model_id, model.vocab_size
        self.lock = threading.Lock()
        self.matrix = AdjacencyMatrix(model.vocab_size, min(options.k, model.vocab_size), model.device)
        self.store = OutputStore(options.store_capacity)
        # Key -> accepted over base of tried nodes, so that base * rate estimates a node's chance
        # given its parent whatever its base
        # (the prior reads the class's table, not self: a closure over self would make a reference
        # cycle, and a dropped drafter would hold its matrix until the cycle collector ran)
        prior = self.PRIOR
        self.rates: RateTable[Key] = RateTable(lambda key: prior[key[0][0]], self.EMA, self.RELAX, _valid_key)
        self.counters = {s: {"proposed": 0, "accepted": 0, "contributed": 0.0} for s in SOURCES}
        self._finished: deque[tuple[tuple[int, ...], int]] = deque(maxlen=SHARE_BACKLOG)  # kept here, not exported
        self._unsaved = False
        self._writing = threading.Lock()
        if options.store:
            check_location(options.store)  # refused now, not at the first write
            if Path(options.store).exists():
                self.store.load(options.store, self.model_id, self.vocab_size)

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> AutoSession:
        return AutoSession(self, prompt, documents)

    @staticmethod
    def key(kind: Kind, depth: int, hot: bool) -> Key:
        return kind, min(depth, DEPTH_KEYS), hot

    def rate(self, key: Key) -> float:
        """Estimated chance, per unit of base, that a node of ``key`` is accepted given its parent
        was. Read without the lock: a racing update only makes it a step stale."""
        return self.rates.value(key)

    def learn(self, outcomes: Sequence[tuple[dict[Kind, float], int, bool]], hot: bool, skipped: set[Key],
              verified: Verified | None = None) -> None:
        """Record each tried node's outcome (its kinds with their bases, depth, accepted), relax
        the skipped keys toward their prior, and recycle the verified logits (if given)."""
        with self.lock:
            if verified is not None:
                self.matrix.update(verified.tree.tokens, verified.logits)
            for kinds, depth, accepted in outcomes:
                for kind, base in kinds.items():
                    self.rates.learn(self.key(kind, depth, hot), float(accepted), base)
                    counter = self.counters[kind[0]]
                    counter["accepted"] += int(accepted)
                    counter["contributed"] += float(accepted) / len(kinds)
            for key in skipped:
                self.rates.relax(key)

    def count_proposed(self, sent: Sequence[dict[Kind, float]]) -> None:
        with self.lock:
            for kinds in sent:
                for kind in kinds:
                    self.counters[kind[0]]["proposed"] += 1

    def remember(self, output: Sequence[int], lead: Sequence[int]) -> None:
        """Add a finished request's output, after the end of its prompt, to the store."""
        with self.lock:
            kept = self.store.add(output, lead)
            if kept is not None:
                self._finished.append(kept)
            self._unsaved = True

    def export_learned(self) -> Learned:
        """What was learned here since the last export (:mod:`triedec.drafters.learned`): the
        outputs that finished here (the latest :data:`SHARE_BACKLOG`), the matrix rows written
        here, the rates updated here."""
        with self.lock:
            outputs = tuple((doc[:start], doc[start:]) for doc, start in self._finished)
            self._finished.clear()
            return Learned(outputs, self.matrix.take_written(), self.rates.export())

    def absorb_learned(self, learned: Learned) -> None:
        """Merge another replica's: its outputs join the store, its matrix rows are taken unless
        written here since, its rates are blended into these."""
        learned.check_tokens(self.vocab_size)
        with self.lock:
            self.matrix.put_rows(learned.rows)
            for lead, output in learned.outputs:
                self.store.add(output, lead)
            self._unsaved = self._unsaved or bool(learned.outputs)
            self.rates.absorb(learned.rates)

    def max_learned_bytes(self) -> int:
        """The recycling matrix plus the store at its bound (``store_capacity`` tokens at
        :data:`STORE_BYTES_PER_TOKEN`); the rates are negligible."""
        return self.matrix.nbytes + self.options.store_capacity * STORE_BYTES_PER_TOKEN

    def persist(self) -> None:
        """Write the store to ``store`` (if set and changed): its outputs are copied under the
        lock, the file is written outside it."""
        if not self.options.store:
            return
        with self._writing:  # writes land in the order their snapshots were taken
            with self.lock:
                if not self._unsaved:
                    return
                docs, self._unsaved = list(self.store.docs.values()), False
            OutputStore.write(self.options.store, self.model_id, docs)

    def stats(self) -> dict[str, float]:
        with self.lock:
            out = {f"{s}_{k}": float(v) for s, c in self.counters.items() for k, v in c.items()}
            out["store_size"] = float(self.store.tokens)
            out["store_outputs"] = float(len(self.store.docs))
            return out


class AutoSession(BaseSession):
    def __init__(self, drafter: AutoDrafter, prompt: Sequence[int], documents: Sequence[Sequence[int]]) -> None:
        self.drafter = drafter
        options = drafter.options
        # the context trie is built at the first step that drafts, not here: a request admitted
        # while steps run plain (a loaded server's, where drafting does not pay) never pays for it,
        # and its first token does not wait for it (pure Python, ~45 us a token of prompt)
        self.trie = NgramTrie(options.n, min(3, options.n - 1))
        self.documents = documents
        self.stream: TrieStream | None = None  # None until the trie is built
        self.fed = 0  # tokens of the context in the trie (documents apart)
        self.prompt_len = len(prompt)
        self.context: Sequence[int] = prompt  # the last proposal's context
        self.last: tuple[int, ...] = ()  # the tokens the last step emitted after it
        self.hot = False
        self._sent: list[dict[Kind, float]] = []  # kinds and bases of each proposed node, in tree order
        self._depths: list[int] = []  # depth of each proposed node
        self._plain = False  # the last proposal was asked for the root alone (a step that does not draft)
        self.from_store = 0  # accepted draft tokens the store proposed (this request)

    # ---- propose ------------------------------------------------------------------------------

    def _candidates(self, context: Sequence[int]) -> dict[tuple[int, ...], _Node]:
        d, o = self.drafter, self.drafter.options
        nodes: dict[tuple[int, ...], _Node] = {}

        def offer(path: tuple[int, ...], kind: Kind, base: float) -> None:
            node = nodes.get(path)
            if node is None:  # add it and its missing ancestors, shallowest first
                known = len(path) - 1
                while known > 0 and path[:known] not in nodes:
                    known -= 1
                for i in range(known + 1, len(path) + 1):
                    node = nodes[path[:i]] = _Node(path[i - 1], path[: i - 1], {})
                assert node is not None
            node.base[kind] = max(node.base.get(kind, 0.0), base)

        # context: the trie's most frequent continuations of the longest matched suffix (base:
        # the share of the parent's occurrences that continue this way)
        matched, m = self.trie.match(context)
        if matched:
            trie, where = self.trie, {matched: ()}
            for v in trie.top(matched, o.max_nodes):
                path = (*where[trie.parent[v]], trie.token[v])
                where[v] = path
                if len(path) <= o.depth:
                    offer(path, ("context", m), trie.freq[v] / trie.freq[trie.parent[v]])
        with d.lock:
            # store: continuations of the context's last tokens in earlier outputs, longest match first
            for cont, length in d.store.continuations(context, o.depth):
                for i in range(1, len(cont) + 1):
                    offer(cont[:i], ("store", _match_class(length)), 1.0)
            # recycling: the matrix's candidates after the root, and after the best of those
            frontier: list[tuple[int, ...]] = [()]
            for width in RECYCLING_RANKS:
                nxt = []
                for path in frontier:
                    token = path[-1] if path else int(context[-1])
                    if not bool(d.matrix.filled[token]):
                        continue
                    row = d.matrix.table[token, : min(width, d.matrix.k)].tolist()
                    for rank, cand in enumerate(row):
                        offer((*path, int(cand)), ("recycling", rank), 1.0)
                        nxt.append((*path, int(cand)))
                frontier = nxt[:1]
        return nodes

    def score(self, nodes: dict[tuple[int, ...], _Node]) -> dict[tuple[int, ...], float]:
        """Each candidate's chance to be accepted (the root's is 1): given its parent,
        ``1 - prod (1 - base * rate)`` over the kinds that proposed it; siblings' chances scaled
        down together where they add up to more than 1 (at most one child is accepted); times
        the parent's chance."""
        d = self.drafter
        given: dict[tuple[int, ...], float] = {}  # chance given the parent was accepted
        siblings: dict[tuple[int, ...], float] = {}  # a parent's children's chances added up
        for path, node in nodes.items():
            miss = 1.0
            for kind, base in node.base.items():
                miss *= 1.0 - min(1.0, base * d.rate(d.key(kind, len(path), self.hot)))
            given[path] = 1.0 - miss
            siblings[node.parent] = siblings.get(node.parent, 0.0) + given[path]
        chance: dict[tuple[int, ...], float] = {(): 1.0}
        for path in sorted(nodes, key=len):  # parents first; at most one child is accepted
            parent = nodes[path].parent
            chance[path] = chance[parent] * given[path] / max(1.0, siblings[parent])
        return chance

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft:
        o = self.drafter.options
        if max_nodes <= 1:
            # the root alone (a plain step, or one the request's gate skips): nothing is looked up,
            # and the context trie takes the new tokens when the session next drafts, so that a
            # step that does not draft costs about what ``ar``'s does
            self._sent, self._depths, self.context, self._plain = [{}], [0], context, True
            return Draft.scored(TokenTree((int(context[-1]),), (-1,)), [1.0], not o.sized, [()])
        self._plain = False
        if self.stream is None:  # the first drafting step: the documents and the context at once
            self.stream = self.trie.build([*self.documents, context])
            self.fed = len(context)
        elif len(context) > self.fed:
            self.trie.add(context[self.fed :], self.stream)
            self.fed = len(context)
        nodes = self._candidates(context)
        chance = self.score(nodes)
        count = min(o.max_nodes, max_nodes - 1)
        ranked = heapq.nlargest(count, (p for p in nodes if chance[p] > 0), key=lambda p: (chance[p], -len(p)))
        ranked.sort(key=lambda p: (-chance[p], len(p)))  # best first; a child never precedes its parent
        index = {(): 0}
        tokens, parents, chances, self._sent, self._depths = [int(context[-1])], [-1], [1.0], [{}], [0]
        sources: list[tuple[str, ...]] = [()]
        for p in ranked:
            index[p] = len(tokens)
            tokens.append(p[-1])
            parents.append(index[p[:-1]])
            chances.append(chance[p])
            self._sent.append(nodes[p].base)
            self._depths.append(len(p))
            have = {kind[0] for kind in nodes[p].base}
            sources.append(tuple(s for s in ORIGIN_ORDER if s in have))
        self.context = context
        return Draft.scored(TokenTree(tuple(tokens), tuple(parents)), chances, not o.sized, sources)

    # ---- observe ------------------------------------------------------------------------------

    def observe(self, verified: Verified) -> None:
        """Learn from the verified nodes (tried: their parent was accepted); the proposed nodes
        the engine did not verify relax their keys toward the prior."""
        d = self.drafter
        tree, path = verified.tree, verified.acceptance.path
        if self._plain and tree.size == 1:  # the root alone: nothing tried, nothing skipped, no row recycled
            self.hot, self.last, self._sent, self._depths = False, verified.acceptance.tokens, [], []
            return
        on_path = set(path)
        kinds = [self._sent[verified.index(i)] for i in range(tree.size)] if self._sent else []
        outcomes = [(kinds[i], tree.depths[i], i in on_path)
                    for i in range(1, len(kinds)) if tree.parents[i] in on_path]
        verified_nodes = {verified.index(i) for i in range(tree.size)}
        skipped = {d.key(kind, self._depths[j], self.hot) for j in range(1, len(self._sent)) if j not in verified_nodes
                   for kind in self._sent[j]}
        self.from_store += sum(1 for i in path if i and any(kind[0] == "store" for kind in kinds[i]))
        d.count_proposed(kinds[1:])
        # a step asked for the root alone does not recycle its row (a top-k over the vocabulary,
        # ~50 us: most of what a plain step would cost beyond ``ar``'s); a drafting step recycles
        # every verified row, its root's too, even when it found nothing to propose
        d.learn(outcomes, self.hot, skipped, None if self._plain else verified)
        self.hot = len(path) > 1
        self.last = verified.acceptance.tokens
        self._sent, self._depths = [], []

    def end(self) -> None:
        """The request's output (as far as this session saw it) goes into the store."""
        self.drafter.remember([*self.context[self.prompt_len :], *self.last], self.context[: self.prompt_len])

    def stats(self) -> dict[str, float]:
        return {**self.drafter.stats(), FROM_STORE: float(self.from_store)}
