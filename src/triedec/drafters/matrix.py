"""Token Recycling's adjacency matrix (Luo et al.): row t holds the model's top-k next tokens last
seen after token t. recycling drafts a whole tree template from it; auto takes its best ranks as
one of its sources. Both write every verified position's top-k back into it (auto on the steps it
drafts: a step that verifies its root alone does not pay for a top-k).

Lives on the model's device. Not thread-safe by itself: its owner (the drafter) locks around it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from triedec.core.errors import StateFileError, TriedecError, positive_int
from triedec.core.rowops import topk_indices
from triedec.drafters.learned import Row
from triedec.drafters.state import load_state, save_state

STATE_FORMAT = "triedec-recycling-1"
"""The format tag of a saved matrix (recycling's ``state=`` file)."""


class AdjacencyMatrix:
    """``table [vocab, k]``: row t holds the top-k next tokens last seen after token t;
    ``filled [vocab]``: whether row t was ever written; ``written [vocab]``: whether row t was
    written here since the last :meth:`take_written` (what another replica is sent). All live on
    the model's device."""

    def __init__(self, vocab_size: int, k: int, device: torch.device) -> None:
        positive_int("vocab_size", vocab_size)
        positive_int("k", k)
        if k > vocab_size:
            raise TriedecError(f"k ({k}) cannot exceed the vocabulary size ({vocab_size})")
        self.vocab_size, self.k, self.device = vocab_size, k, device
        self.table = torch.zeros((vocab_size, k), dtype=torch.long, device=device)
        self.filled = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.written = torch.zeros(vocab_size, dtype=torch.bool, device=device)

    def update(self, tokens: Sequence[int], logits: torch.Tensor) -> None:
        """Write the indices of ``logits[i]``'s top k (:func:`~triedec.core.rowops.topk_indices`) into
        row ``tokens[i]`` for every i (``tokens [T]``, ``logits [T, vocab]``). Duplicate tokens:
        the last position wins."""
        last = {int(t): i for i, t in enumerate(tokens)}  # each token's last position
        if self.device.type == "cpu" and logits.device.type == "cpu" and not logits.requires_grad:
            # numpy's indexing, outside inference mode: a few us where torch's takes tens (run for
            # every verified row of every step)
            top = topk_indices(logits, self.k).numpy()  # [T, k]
            rows = np.fromiter(last, dtype=np.int64, count=len(last))
            self.table.numpy()[rows] = top[np.fromiter(last.values(), dtype=np.int64, count=len(last))]
            self.filled.numpy()[rows] = True
            self.written.numpy()[rows] = True
            return
        with torch.inference_mode():
            found = topk_indices(logits.to(self.device), self.k)  # [T, k]
            index = torch.tensor(list(last), dtype=torch.long, device=self.device)
            self.table[index] = found[torch.tensor(list(last.values()), dtype=torch.long, device=self.device)]
            self.filled[index] = True
            self.written[index] = True

    @torch.inference_mode()
    def take_written(self) -> tuple[Row, ...]:
        """The rows written here since the last call, each (token, its row); marks them sent."""
        rows = self.written.nonzero().flatten()
        found = tuple(zip(rows.tolist(), map(tuple, self.table[rows].tolist()), strict=True))
        self.written[rows] = False
        return found

    @torch.inference_mode()
    def put_rows(self, rows: Sequence[Row]) -> None:
        """Take another replica's rows (last writer wins), except those written here since the
        last :meth:`take_written` (this replica wrote them later). Rows of another width or token
        ids outside the vocabulary are refused with a clear error (the matrix is then unchanged)."""
        if any(len(row) != self.k for _, row in rows):
            raise TriedecError(f"matrix rows of another width than this matrix's k ({self.k})")
        if any(not 0 <= t < self.vocab_size for token, row in rows for t in (token, *row)):
            raise TriedecError(f"matrix rows hold token ids beyond this vocabulary ({self.vocab_size})")
        if not rows:
            return
        tokens = torch.tensor([token for token, _ in rows], dtype=torch.long, device=self.device)
        values = torch.tensor([row for _, row in rows], dtype=torch.long, device=self.device)
        keep = ~self.written[tokens]
        self.table[tokens[keep]] = values[keep]
        self.filled[tokens[keep]] = True

    @property
    def nbytes(self) -> int:
        """Memory its tensors take (fixed by vocab and k)."""
        return sum(t.element_size() * t.numel() for t in (self.table, self.filled, self.written))

    def copy(self) -> AdjacencyMatrix:
        """An independent copy (a snapshot to write while the original keeps learning)."""
        other = AdjacencyMatrix.__new__(AdjacencyMatrix)
        other.vocab_size, other.k, other.device = self.vocab_size, self.k, self.device
        other.table, other.filled, other.written = self.table.clone(), self.filled.clone(), self.written.clone()
        return other

    def filled_share(self) -> float:
        return float(self.filled.float().mean())

    # ---- persistence --------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str], model_id: str) -> None:
        """Write the matrix to ``path`` (safetensors, replaced atomically), tagged with the model."""
        meta = {"format": STATE_FORMAT, "model_id": model_id, "vocab_size": str(self.vocab_size), "k": str(self.k)}
        save_state(path, {"table": self.table, "filled": self.filled}, meta)

    def load(self, path: str | os.PathLike[str], model_id: str) -> None:
        """Replace the matrix with the one saved in ``path``; refuse a file from another model,
        vocabulary or k, and a corrupt one, with a clear error (the matrix is then unchanged)."""
        meta, tensors = load_state(path, "recycling state", "state", STATE_FORMAT)
        if meta.get("vocab_size") != str(self.vocab_size) or meta.get("k") != str(self.k):
            raise TriedecError(
                f"recycling state {path} is for vocabulary {meta.get('vocab_size')} and k={meta.get('k')}; "
                f"this model has vocabulary {self.vocab_size} and k={self.k}"
            )
        if meta.get("model_id") != model_id:
            raise StateFileError(f"recycling state {path} was saved for another model ({meta.get('model_id')!r})")
        table, filled = tensors.get("table"), tensors.get("filled")
        if (
            table is None or filled is None or table.dtype != torch.long or filled.dtype != torch.bool
            or table.shape != (self.vocab_size, self.k) or filled.shape != (self.vocab_size,)
            or bool(((table < 0) | (table >= self.vocab_size)).any())
        ):
            raise StateFileError(f"recycling state {path} is corrupt (bad tensors)")
        self.table = table.to(self.device)
        self.filled = filled.to(self.device)
