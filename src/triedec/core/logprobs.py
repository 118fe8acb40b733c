"""Each generated token's logprob and its most likely alternatives, from the rows a step verified.

Pure core: imports torch and :mod:`triedec.core.params` only.

A token's logits are the same bits whatever tree, batch or load carried it (the engine's
exactness), and :func:`token_logprob` is a function of one row alone: so every method reports the
same logprobs as ``ar`` for the same request and seed, bit for bit, and costs no extra forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from triedec.core.params import LOGPROB_MODES, MAX_TOP_LOGPROBS, Logprobs

__all__ = ["LOGPROB_MODES", "MAX_TOP_LOGPROBS", "Logprobs", "TokenLogprob", "token_logprob", "token_logprobs"]


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token (an id), its logprob, and the ``top`` most likely tokens with theirs:
    ``(id, logprob)`` pairs, most likely first (ties: the lower id first), tokens the distribution
    excludes (``-inf``: filtered by top-k, top-p or min-p) left out; ``rank``: 1 + the number of
    tokens strictly more likely than ``token`` (vLLM's rank; 0 where not asked for: it costs a
    pass over the row)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0

    def cut(self, top: int) -> TokenLogprob:
        """This entry with its ``top`` most likely alternatives only."""
        return self if len(self.top) <= top else replace(self, top=self.top[:top])


def token_logprob(scores: torch.Tensor, token: int, top: int, rank: bool = False) -> TokenLogprob:
    """``token``'s logprob under ``scores`` (one row ``[V]`` of logits, any dtype or device: the
    model's own, or processed, :mod:`triedec.core.sampling`), as ``torch.log_softmax`` of the row
    in float32 on the CPU, with the ``top`` most likely tokens (0: none) and, with ``rank``, its
    rank."""
    return token_logprobs(scores.reshape(1, -1), [token], top, rank)[0]


def token_logprobs(scores: torch.Tensor, tokens: Sequence[int], top: int, ranks: bool = False) -> list[TokenLogprob]:
    """:func:`token_logprob` of each row of ``scores`` ``[R, V]`` and its token, in one pass
    over the block (a row's values are the same bits whatever block it is scored in: the
    log-softmax of a row reads that row alone)."""
    if not len(tokens):
        return []
    logp = torch.log_softmax(scores.detach().to("cpu", torch.float32), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.long)
    values = logp.gather(1, ids[:, None])
    counted = ((logp > values).sum(dim=1) + 1).tolist() if ranks else [0] * len(tokens)
    chosen = values[:, 0].tolist()
    out = []
    if top:
        best, best_ids = torch.topk(logp, min(top, logp.shape[1]), dim=1)
        for token, value, rank, row_values, row_ids in zip(tokens, chosen, counted, best.tolist(),
                                                           best_ids.tolist(), strict=True):
            pairs = [(int(i), float(v)) for i, v in zip(row_ids, row_values, strict=True) if v != -math.inf]
            out.append(TokenLogprob(int(token), float(value), tuple(sorted(pairs, key=lambda p: (-p[1], p[0]))),
                                    int(rank)))
    else:
        out = [TokenLogprob(int(t), float(v), (), int(r))
               for t, v, r in zip(tokens, chosen, counted, strict=True)]
    return out
