"""The output store: a bounded cross-request memory of a loaded model's earlier outputs, each
after the end of its prompt, indexed by the runs of tokens that precede each output token, so that
auto drafts a question asked again from its earlier answer from the first token.

Not thread-safe by itself: its owner (auto's drafter) locks around it. Saved and loaded as a
safetensors state file (:mod:`triedec.drafters.state`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import torch

from triedec.core.errors import StateFileError
from triedec.drafters.state import load_state, save_state

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
STORE_BYTES_PER_TOKEN = 600
"""Memory the store takes per token it keeps, its index included, rounded up from what was measured
with tracemalloc (2026-11-25): 220-260 bytes on text-like token streams, 580 on uniformly random
tokens (every key distinct, the worst case)"""


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
