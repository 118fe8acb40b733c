"""Sampling parameters, the processing of one next-token distribution, and position-keyed draws.

Pure core: imports only :mod:`triedec.core.params`, torch and numpy.

* :class:`Sampling` -- ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` and
  ``seed``, with transformers' names and meanings, validated on construction (declared in
  :mod:`triedec.core.params`, which needs no torch; re-exported here). ``temperature=0``
  (the default) is greedy decoding.
* :func:`process` -- one row of logits processed as transformers' ``generate(do_sample=True)``
  processes it, in its order: repetition penalty (over the tokens of the row's own prefix, prompt
  included), temperature, top-k, top-p, min-p; OpenAI's and vLLM's logit bias, ``min_tokens`` and
  presence and frequency penalties before them (:func:`adjust`, also what greedy decoding reads).
* :func:`uniform` -- the uniform number for output position i: a counter-based generator
  (numpy's Philox, keyed by the seed, counter = i), so it depends only on ``(seed, i)``.
* :func:`draw` -- inverse-CDF sampling over the fixed token-id order with that number.

Together they make sampled text a function of (model, prompt, parameters, seed) alone: whatever
drafts a method verified, the token at output position i is drawn from the same distribution with
the same number, so every speculative method returns ``ar``'s tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from triedec.core.params import GREEDY_SAMPLING, MAX_SEED, PENALTY_RANGE, SAMPLING_FIELDS, Sampling

__all__ = ["GREEDY_SAMPLING", "MAX_SEED", "PENALTY_RANGE", "SAMPLING_FIELDS", "Sampling", "adjust", "draw", "process",
           "seen_tokens", "uniform"]



def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty on one row ``[V]``: the logits of the token ids ``seen``
    (any order, repeats allowed) divided by ``penalty`` where positive, multiplied where negative.
    Returns a new tensor; ``logits`` is not mutated."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    scores = logits[seen]
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(0, seen, scores)


def adjust(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling, position: int = 0,
           suppress: Sequence[int] = ()) -> torch.Tensor:
    """One row of next-token logits ``[V]`` changed as :class:`Sampling` says before temperature
    and the filters, in this order: ``logit_bias`` added; ``suppress`` (the end-of-sequence and stop
    ids) set to ``-inf`` while ``position`` (the tokens already out) is below ``min_tokens``; the
    repetition penalty over ``seen`` (the token ids of this row's own prefix, prompt included);
    the presence and frequency penalties over the last ``position`` of them (the output so far).
    What greedy decoding takes the argmax of. Returns ``logits`` itself when nothing applies (the
    repetition penalty alone keeps the row's dtype); the other steps work in float32."""
    row = logits
    if sampling.logit_bias:
        ids, biases = zip(*sampling.logit_bias, strict=True)
        row = row.float().index_add(0, torch.tensor(ids), torch.tensor(biases, dtype=torch.float32))
    if position < sampling.min_tokens and suppress:
        row = row.float().index_fill(0, torch.tensor(sorted(suppress)), -math.inf)
    row = penalize(row, seen, sampling.repetition_penalty)
    if (sampling.presence_penalty or sampling.frequency_penalty) and position:
        ids, counts = torch.unique(seen[seen.numel() - position :], return_counts=True)
        minus = sampling.frequency_penalty * counts.float() + sampling.presence_penalty
        row = row.float().index_add(0, ids, -minus)
    return row


def process(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling, position: int = 0,
            suppress: Sequence[int] = ()) -> torch.Tensor:
    """One row of next-token logits ``[V]`` processed as transformers' sampling does, in its order:
    :func:`adjust` (logit bias, ``min_tokens``, the penalties; ``seen``: the token ids of this
    row's own prefix, of which the last ``position`` are output), temperature, top-k, top-p,
    min-p. Filtered tokens get ``-inf``. Returns a new float32 tensor.

    A temperature so small that the scaled logits overflow (their maximum is not finite) gives the
    limit of the distribution as the temperature goes to 0: all mass on the greedy token (the
    first argmax), every other token ``-inf``."""
    row = adjust(logits.float(), seen, sampling, position, suppress)
    if sampling.temperature not in (0.0, 1.0):
        scaled = row / sampling.temperature
        if not bool(torch.isfinite(scaled.max())):
            scaled = torch.full_like(row, -math.inf)
            scaled[row.argmax()] = 0.0
        row = scaled
    if sampling.top_k:
        kth = torch.topk(row, min(sampling.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, -math.inf)
    if sampling.top_p < 1.0:
        ascending, order = torch.sort(row)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[-1] = False  # the most likely token always stays
        row = row.masked_fill(drop.scatter(0, order, drop), -math.inf)
    if sampling.min_p > 0.0:
        probs = row.softmax(dim=-1)
        drop = probs < sampling.min_p * probs.max()
        drop[probs.argmax()] = False
        row = row.masked_fill(drop, -math.inf)
    return row


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) for output position ``position`` (0 = the first new token):
    numpy's counter-based Philox generator keyed by ``seed`` at counter ``position``. A function of
    ``(seed, position)`` alone."""
    return float(np.random.Generator(np.random.Philox(key=seed, counter=position)).random())


DRAW_BLOCK = 256
"""Tokens per block of :func:`draw`'s two-level cumulative sum."""


def draw(logits: torch.Tensor, u: float) -> int:
    """Inverse-CDF sampling from ``softmax(logits)`` (one row ``[V]``, ``-inf`` = excluded) with the
    uniform number ``u``: the first token id, in id order, whose cumulative weight exceeds ``u``
    times the total. Computed on the CPU, so the draw does not depend on the device, in this order:
    each token's weight ``exp(logit - max)`` in float32, widened to float64; the weights summed per
    block of :data:`DRAW_BLOCK` tokens (numpy's pairwise sum of the block) and the block sums
    accumulated in id order, which finds the block; then the cumulative weights inside that block
    in id order from the sum before it, which find the token: two short sequential sums instead
    of one over the whole vocabulary. The same function for every method, so every method draws
    the same token from the same row."""
    row = logits.detach().to("cpu", torch.float32).reshape(-1).numpy()
    weights = np.exp(row - row.max()).astype(np.float64)  # -inf -> 0
    blocks = -(-weights.size // DRAW_BLOCK)
    if weights.size == blocks * DRAW_BLOCK:  # whole blocks (the default model's 49,152): no copy
        padded = weights
    else:  # the last block zero-padded, so that every block sums 256 values alike
        padded = np.zeros(blocks * DRAW_BLOCK)
        padded[: weights.size] = weights
    ends = np.cumsum(padded.reshape(blocks, DRAW_BLOCK).sum(axis=1))
    target = u * float(ends[-1])
    b = int(np.searchsorted(ends, target, side="right"))
    if b >= blocks:  # u * total rounded up to the total: the last token with mass
        return int(np.flatnonzero(weights)[-1])
    block = padded[b * DRAW_BLOCK : (b + 1) * DRAW_BLOCK]
    within = np.cumsum(block)
    if b:
        within += ends[b - 1]
    j = int(np.searchsorted(within, target, side="right"))
    if j >= DRAW_BLOCK:  # the block's own sums rounded below the target: its last token with mass
        j = int(np.flatnonzero(block)[-1])
    return b * DRAW_BLOCK + j


def seen_tokens(context: Sequence[int], extra: Sequence[int] = ()) -> torch.Tensor:
    """The token ids of a prefix (``context`` then ``extra``) as a long tensor, for :func:`process`."""
    return torch.tensor([*context, *extra], dtype=torch.long)
