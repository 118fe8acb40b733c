"""Each generated token's logprob and its most likely alternatives, from the rows a step verified.

Pure core: imports torch and :mod:`triedec.core.params` only.

A token's logits are the same bits whatever tree, batch or load carried it (the engine's
exactness), and :func:`token_logprob` is a function of one row alone: so every method reports the
same logprobs as ``ar`` for the same request and seed, bit for bit, and costs no extra forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from triedec.core.params import LOGPROB_MODES, MAX_TOP_LOGPROBS, Logprobs

__all__ = ["LOGPROB_MODES", "MAX_TOP_LOGPROBS", "Logprobs", "TokenLogprob", "token_logprob"]


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token (an id), its logprob, and the ``top`` most likely tokens with theirs:
    ``(id, logprob)`` pairs, most likely first (ties: the lower id first), tokens the distribution
    excludes (``-inf``: filtered by top-k, top-p or min-p) left out; ``rank``: 1 + the number of
    tokens strictly more likely than ``token`` (vLLM's rank)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 1

    def cut(self, top: int) -> TokenLogprob:
        """This entry with its ``top`` most likely alternatives only."""
        return self if len(self.top) <= top else replace(self, top=self.top[:top])


def token_logprob(scores: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s logprob under ``scores`` (one row ``[V]`` of logits, any dtype or device: the
    model's own, or processed, :mod:`triedec.core.sampling`), as ``torch.log_softmax`` of the row
    in float32 on the CPU, with the ``top`` most likely tokens (0: none)."""
    logp = torch.log_softmax(scores.detach().to("cpu", torch.float32), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logp, min(top, logp.numel()))
        pairs = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v != -math.inf]
        alternatives = tuple(sorted(pairs, key=lambda pair: (-pair[1], pair[0])))
    value = logp[token]
    return TokenLogprob(int(token), float(value), alternatives, int((logp > value).sum()) + 1)
