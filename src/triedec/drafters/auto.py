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
  from every verified position): ranks 0-3 after the root, 0-1 after those, 0 after the best
  (base chance 1).

Candidates are merged into one trie (a path proposed by several sources is one node). Each node
is scored by the measured acceptance of the *kinds* that proposed it: a kind is a source with its
detail (the context's matched suffix length, the store's match class, the recycling rank), and
acceptance is measured per (kind, depth, hot), where hot means the previous step accepted a draft:
two moving averages over tried nodes (those whose parent was accepted), of accepted and of base,
whose ratio is the rate, so that ``base * rate`` estimates a node's chance given its parent
whatever its base. Given its parent, a node's chance is ``1 - prod (1 - base * rate)`` over its
kinds (merged evidence); siblings whose chances add up to more than 1 are scaled down together
(at most one child is accepted); its chance to be accepted is that times its parent's. The draft
lists the nodes best first by that chance, and the engine's allocator (:mod:`triedec.allocate`)
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
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from triedec.drafters.base import (
    FROM_STORE,
    MAX_TREE_NODES,
    NEEDS_COST,
    STATE_FILE,
    BaseSession,
    Draft,
    ModelInfo,
    Verified,
    at_most,
    register,
)
from triedec.drafters.estimate import MovingRatio, absorb_rates, export_rates
from triedec.drafters.learned import Learned
from triedec.drafters.ngram_trie import NgramTrie
from triedec.drafters.recycling import AdjacencyMatrix
from triedec.drafters.state import check_location, load_state, save_state
from triedec.errors import StateFileError, TriedecError, positive_int
from triedec.tree import TokenTree

METHOD = "auto"
SOURCES = ("context", "store", "recycling")
ORIGIN_ORDER = ("store", "context", "recycling")
"""a node several sources proposed names them in this order in its draft's ``sources`` (the first
is the origin its accepted token reports: the store's, where it had one)"""
STORE_FORMAT = "triedec-output-store-v1"
KEYS = (3, 8)
"""the store is indexed by the last 3 and by the last 8 tokens (a long repeat stays findable after
its short key has been followed by newer outputs)"""
PER_KEY = 4
"""occurrences kept per key in the store (the most recent)"""
LEAD = 16
"""prompt tokens kept before each output: the end of the question it answered, so that an answer
is found again from its first token when a question is asked again"""
LONGEST_MATCH = 16
"""store matches are measured up to this length"""
DEPTH_KEYS = 4
"""acceptance is measured per depth 1 .. DEPTH_KEYS - 1, and for all deeper nodes together"""
RECYCLING_RANKS = (4, 2, 1)
"""candidates taken from the matrix at depths 1, 2, 3 (the latter two under the best parent only)"""
STORE_BYTES_PER_TOKEN = 600
"""Memory the store takes per token it keeps, its index included, rounded up from what was measured
with tracemalloc (2026-11-25): 220-260 bytes on text-like token streams, 580 on uniformly random
tokens (every key distinct, the worst case)"""
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
    store_tokens: int = field(default=200_000, metadata=at_most(1_000_000))
    """bound on the tokens the cross-request store keeps (oldest outputs evicted first)"""
    store: str = field(default="", metadata=STATE_FILE)
    """file the store is loaded from (if it exists) and saved to after every request"""
    k: int = field(default=8, metadata=at_most(64))
    """candidates per row of the recycling matrix"""
    sized: bool = True
    """size each tree by the device's cost curve (False: send every ranked node)"""

    def __post_init__(self) -> None:
        for name in ("max_nodes", "depth", "store_tokens", "k"):
            positive_int(name, getattr(self, name))
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 2:
            raise TriedecError(f"n must be an integer >= 2, got {self.n!r}")
        if not isinstance(self.store, str):
            raise TriedecError(f"store must be a file path, got {self.store!r}")
        if not isinstance(self.sized, bool):
            raise TriedecError(f"sized must be true or false, got {self.sized!r}")


class OutputStore:
    """Earlier outputs, oldest first, each after the last :data:`LEAD` tokens of its prompt (its
    *lead*), at most ``capacity`` tokens in all (leads included). Indexed by every run of each
    length in :data:`KEYS` that is followed by an output token -> the most recent :data:`PER_KEY`
    places. Not thread-safe by itself: the drafter locks around it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.docs: OrderedDict[int, tuple[tuple[int, ...], int]] = OrderedDict()  # id -> (lead + output, lead length)
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.tokens = 0
        self._next = 0
        self._ids: dict[tuple[tuple[int, ...], int], int] = {}  # (lead + output, lead length) -> id

    @staticmethod
    def _keys(doc: tuple[int, ...], start: int) -> list[tuple[int, tuple[int, ...]]]:
        """``(end, key)`` for every indexed run of ``doc``: a key of each length ending at an
        output position (``end >= start``)."""
        return [(end, doc[end - n : end]) for n in KEYS for end in range(max(n, start), len(doc))]

    def add(self, output: Sequence[int], lead: Sequence[int] = ()) -> tuple[tuple[int, ...], int] | None:
        """Keep ``output`` after the last :data:`LEAD` tokens of ``lead`` (its prompt); evict the
        oldest outputs beyond the bound. An output too short to index, or longer than the whole
        store, is not kept; one the store holds already (same lead) becomes the newest instead of
        being kept twice. Returns what was kept: (lead + output, lead length), or None."""
        head = tuple(int(t) for t in lead)[-LEAD:]
        doc = head + tuple(int(t) for t in output)
        if len(doc) <= min(KEYS) or len(doc) == len(head) or len(doc) > self.capacity:
            return None
        entry = (doc, len(head))
        if entry in self._ids:
            self._remove(self._ids[entry])
        doc_id, self._next = self._next, self._next + 1
        self.docs[doc_id] = entry
        self._ids[entry] = doc_id
        self.tokens += len(doc)
        for end, key in self._keys(doc, len(head)):
            places = self.index.setdefault(key, [])
            places.append((doc_id, end))
            if len(places) > PER_KEY:
                del places[0]
        while self.tokens > self.capacity:
            self._remove(next(iter(self.docs)))
        return entry

    def _remove(self, doc_id: int) -> None:
        doc, start = entry = self.docs.pop(doc_id)
        del self._ids[entry]
        self.tokens -= len(doc)
        for _, key in self._keys(doc, start):
            places = [p for p in self.index.get(key, ()) if p[0] != doc_id]
            if places:
                self.index[key] = places
            else:
                self.index.pop(key, None)

    def continuations(self, context: Sequence[int], depth: int, count: int = 2) -> list[tuple[tuple[int, ...], int]]:
        """Up to ``count`` distinct continuations (``depth`` tokens at most) of the places where
        the context's last tokens (each length of :data:`KEYS`) occurred, each with its match
        length (how many of the context's last tokens, at most :data:`LONGEST_MATCH`, precede it
        there): longest match first, then most recent."""
        tail = [int(t) for t in context[-LONGEST_MATCH:]]
        seen: set[tuple[int, int]] = set()
        places = []
        for n in sorted(KEYS, reverse=True):
            if len(tail) < n:
                continue
            for doc_id, end in reversed(self.index.get(tuple(tail[-n:]), ())):
                if (doc_id, end) in seen:
                    continue
                seen.add((doc_id, end))
                doc, m = self.docs[doc_id][0], n
                while m < len(tail) and m < end and doc[end - m - 1] == tail[-m - 1]:
                    m += 1
                places.append((-m, len(places), doc[end : end + depth]))
        found: list[tuple[tuple[int, ...], int]] = []
        for m, _, cont in sorted(places):
            if cont and all(cont != c for c, _ in found):
                found.append((cont, -m))
            if len(found) >= count:
                break
        return found

    # ---- persistence --------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str], model_id: str) -> None:
        """Write the outputs with their leads to ``path`` (safetensors, replaced atomically),
        tagged with the model."""
        self.write(path, model_id, list(self.docs.values()))

    @staticmethod
    def write(path: str | os.PathLike[str], model_id: str, docs: Sequence[tuple[tuple[int, ...], int]]) -> None:
        """Write ``docs`` (each lead + output and its lead's length) as a store file."""
        flat = torch.tensor([t for d, _ in docs for t in d], dtype=torch.long)
        lengths = torch.tensor([len(d) for d, _ in docs], dtype=torch.long)
        starts = torch.tensor([start for _, start in docs], dtype=torch.long)
        save_state(path, {"tokens": flat, "lengths": lengths, "starts": starts},
                   {"format": STORE_FORMAT, "model_id": model_id})

    def load(self, path: str | os.PathLike[str], model_id: str, vocab_size: int) -> None:
        """Add the outputs saved in ``path``; refuse a file from another model and a corrupt one
        with a clear error (the store is then unchanged)."""
        meta, tensors = load_state(path, "output store", "store", STORE_FORMAT)
        if meta.get("model_id") != model_id:
            raise StateFileError(f"output store {path} was saved for another model ({meta.get('model_id')!r})")
        flat, lengths = tensors.get("tokens"), tensors.get("lengths")
        starts = tensors.get("starts", torch.zeros_like(lengths) if lengths is not None else None)  # older files
        if (flat is None or lengths is None or flat.dim() != 1 or lengths.dim() != 1 or starts.shape != lengths.shape
                or bool((lengths < 0).any()) or int(lengths.sum()) != flat.numel()
                or bool(((starts < 0) | (starts > lengths)).any())
                or bool(((flat < 0) | (flat >= vocab_size)).any())):
            raise StateFileError(f"output store {path} is corrupt (bad tensors)")
        for doc, start in zip(torch.split(flat, lengths.tolist()), starts.tolist(), strict=True):
            self.add(doc[start:].tolist(), doc[:start].tolist())


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
class AutoDrafter:
    """Shared across requests, under ``lock``: the recycling matrix, the acceptance rates per
    :data:`Key`, the output store and the per-source counters."""

    PRIOR: ClassVar[dict[str, float]] = {"context": 0.8, "store": 0.6, "recycling": 0.3}
    """initial acceptance rate of a tried node, per source"""
    EMA = 0.1
    """weight of a new tried node in the two moving averages behind a rate"""
    RELAX = 0.01
    """how far a skipped key's averages move back toward the prior per step it was skipped"""

    prefill_logits = 0

    def __init__(self, options: AutoOptions, model: ModelInfo) -> None:
        self.options = options
        self.model_id, self.vocab_size = model.model_id, model.vocab_size
        self.lock = threading.Lock()
        self.matrix = AdjacencyMatrix(model.vocab_size, min(options.k, model.vocab_size), model.device)
        self.store = OutputStore(options.store_tokens)
        # Key -> accepted over base of tried nodes, so that base * rate estimates a node's chance
        # given its parent whatever its base
        self._rates: dict[Key, MovingRatio] = {}
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
        found = self._rates.get(key)
        return self.PRIOR[key[0][0]] if found is None else found.value

    def _ratio(self, key: Key) -> MovingRatio:
        """The rate of ``key`` (created at its source's prior), to update under the lock."""
        if key not in self._rates:
            self._rates[key] = MovingRatio(self.PRIOR[key[0][0]])
        return self._rates[key]

    def learn(self, outcomes: Sequence[tuple[dict[Kind, float], int, bool]], hot: bool, skipped: set[Key],
              verified: Verified | None = None) -> None:
        """Record each tried node's outcome (its kinds with their bases, depth, accepted), relax
        the skipped keys toward their prior, and recycle the verified logits (if given)."""
        with self.lock:
            if verified is not None:
                self.matrix.update(torch.tensor(verified.tree.tokens), verified.logits)
            for kinds, depth, accepted in outcomes:
                for kind, base in kinds.items():
                    self._ratio(self.key(kind, depth, hot)).update(float(accepted), base, self.EMA)
                    counter = self.counters[kind[0]]
                    counter["accepted"] += int(accepted)
                    counter["contributed"] += float(accepted) / len(kinds)
            for key in skipped:
                self._ratio(key).relax(self.RELAX)

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
            return Learned(outputs, self.matrix.take_written(), export_rates(self._rates))

    def absorb_learned(self, learned: Learned) -> None:
        """Merge another replica's: its outputs join the store, its matrix rows are taken unless
        written here since, its rates are blended into these."""
        learned.check_tokens(self.vocab_size)
        with self.lock:
            self.matrix.put_rows(learned.rows)
            for lead, output in learned.outputs:
                self.store.add(output, lead)
            self._unsaved = self._unsaved or bool(learned.outputs)
            absorb_rates(self._ratio, _valid_key, learned.rates)

    def max_learned_bytes(self) -> int:
        """The recycling matrix plus the store at its bound (``store_tokens`` tokens at
        :data:`STORE_BYTES_PER_TOKEN`); the rates are negligible."""
        return self.matrix.nbytes + self.options.store_tokens * STORE_BYTES_PER_TOKEN

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
            out["store_tokens"] = float(self.store.tokens)
            out["store_outputs"] = float(len(self.store.docs))
            return out


class AutoSession(BaseSession):
    def __init__(self, drafter: AutoDrafter, prompt: Sequence[int], documents: Sequence[Sequence[int]]) -> None:
        self.drafter = drafter
        options = drafter.options
        self.trie = NgramTrie(options.n, min(3, options.n - 1))
        for doc in documents:
            self.trie.add(doc)
        self.stream = self.trie.add(prompt)
        self.fed = len(prompt)
        self.prompt_len = len(prompt)
        self.context: Sequence[int] = prompt  # the last proposal's context
        self.last: tuple[int, ...] = ()  # the tokens the last step emitted after it
        self.hot = False
        self._sent: list[dict[Kind, float]] = []  # kinds and bases of each proposed node, in tree order
        self._depths: list[int] = []  # depth of each proposed node
        self.from_store = 0  # accepted draft tokens the store proposed (this request)

    # ---- propose ------------------------------------------------------------------------------

    def _candidates(self, context: Sequence[int]) -> dict[tuple[int, ...], _Node]:
        d, o = self.drafter, self.drafter.options
        nodes: dict[tuple[int, ...], _Node] = {}

        def offer(path: tuple[int, ...], kind: Kind, base: float) -> None:
            for i in range(1, len(path) + 1):
                node = nodes.setdefault(path[:i], _Node(path[i - 1], path[: i - 1], {}))
                if i == len(path):
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
        if len(context) > self.fed:
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
            sources.append(tuple(s for s in ORIGIN_ORDER if any(kind[0] == s for kind in nodes[p].base)))
        self.context = context
        return Draft.scored(TokenTree(tuple(tokens), tuple(parents)), chances, not o.sized, sources)

    # ---- observe ------------------------------------------------------------------------------

    def observe(self, verified: Verified) -> None:
        """Learn from the verified nodes (tried: their parent was accepted); the proposed nodes
        the engine did not verify relax their keys toward the prior."""
        d = self.drafter
        tree, path = verified.tree, verified.acceptance.path
        on_path = set(path)
        kinds = [self._sent[verified.index(i)] for i in range(tree.size)] if self._sent else []
        outcomes = [(kinds[i], tree.depths[i], i in on_path)
                    for i in range(1, len(kinds)) if tree.parents[i] in on_path]
        verified_nodes = {verified.index(i) for i in range(tree.size)}
        skipped = {d.key(kind, self._depths[j], self.hot) for j in range(1, len(self._sent)) if j not in verified_nodes
                   for kind in self._sent[j]}
        self.from_store += sum(1 for i in path if i and any(kind[0] == "store" for kind in kinds[i]))
        d.count_proposed(kinds[1:])
        d.learn(outcomes, self.hot, skipped, verified)
        self.hot = len(path) > 1
        self.last = verified.acceptance.tokens
        self._sent, self._depths = [], []

    def end(self) -> None:
        """The request's output (as far as this session saw it) goes into the store."""
        self.drafter.remember([*self.context[self.prompt_len :], *self.last], self.context[: self.prompt_len])

    def stats(self) -> dict[str, float]:
        return {**self.drafter.stats(), FROM_STORE: float(self.from_store)}
