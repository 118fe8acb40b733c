"""The per-row reductions over logits that every decoding step runs on the host: each row's argmax
(greedy acceptance) and each row's top-k indices (the recycling matrix's update).

On a CPU, torch's last-dimension ``argmax`` and ``topk`` scan a row without vectorising it, so
over a large vocabulary they are several times slower than numpy's vectorised ``argmax`` and
:func:`topk_indices`' two-level search (``docs/batching.md`` has the measurements), a cost paid per
row, for ``ar`` as much as for speculation. Both give torch's answer:

* :func:`argmax` -- numpy's argmax on CPU float rows, torch's elsewhere; both return the first
  index of the maximum, and treat NaN as the maximum (its first index), so greedy decoding picks
  the same token as ``transformers``' ``argmax`` bit for bit;
* :func:`topk_indices` -- the k largest values of each row, largest first (their *values* equal
  ``torch.topk``'s; among equal values the order of indices may differ): the row is cut into
  chunks of :data:`CHUNK`, the k chunks with the largest maxima hold every one of the row's k
  largest values (an element outside them is no larger than k other chunks' maxima), and one
  small ``topk`` over those chunks picks them.

Pure functions of their input; nothing is mutated.
"""

from __future__ import annotations

import torch

from triedec.core.errors import TriedecError

CHUNK = 64
"""columns per chunk in :func:`topk_indices`' first level"""


def argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (``logits [T, V]`` -> T ints): the first index of the row's maximum,
    as ``torch.argmax`` gives it."""
    if logits.dim() != 2:
        raise TriedecError(f"argmax takes [rows, vocab] logits, got shape {tuple(logits.shape)}")
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def topk_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[T, k]`` of each row's k largest values, largest first (``logits [T, V]``, ``k <= V``)."""
    if logits.dim() != 2 or not 1 <= k <= logits.shape[1]:
        raise TriedecError(f"topk_indices takes [rows, vocab] logits and 1 <= k <= vocab, got "
                           f"shape {tuple(logits.shape)} and k={k}")
    rows, vocab = logits.shape
    chunks = vocab // CHUNK
    if logits.device.type != "cpu" or chunks < 4 * k:
        return logits.topk(k, dim=-1).indices
    maxima = logits[:, : chunks * CHUNK].reshape(rows, chunks, CHUNK).amax(dim=-1)  # [T, chunks]
    best = maxima.topk(k, dim=-1).indices  # [T, k]: the chunks that hold the k largest values
    offsets = torch.arange(CHUNK, device=logits.device)
    columns = (best.unsqueeze(-1) * CHUNK + offsets).reshape(rows, k * CHUNK)
    if vocab % CHUNK:  # the columns past the last whole chunk are always candidates
        tail = torch.arange(chunks * CHUNK, vocab, device=logits.device).expand(rows, -1)
        columns = torch.cat([columns, tail], dim=1)
    picked = logits.gather(1, columns).topk(k, dim=-1).indices
    return columns.gather(1, picked)
