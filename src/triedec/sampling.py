"""Sampling parameters, the processing of one next-token distribution, and position-keyed draws.

Pure core: imports only :mod:`triedec.errors`, torch and numpy.

* :class:`Sampling` -- ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` and
  ``seed``, with transformers' names and meanings, validated on construction. ``temperature=0``
  (the default) is greedy decoding.
* :func:`process` -- one row of logits processed as transformers' ``generate(do_sample=True)``
  processes it, in its order: repetition penalty (over the tokens of the row's own prefix, prompt
  included), temperature, top-k, top-p, min-p.
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
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from triedec.errors import TriedecError

MAX_SEED = 2**64
"""Seeds are integers in ``[0, MAX_SEED)``."""
PENALTY_RANGE = (1e-6, 1e6)
"""The repetition penalties accepted: beyond them a float32 logit divided (or multiplied) by the
penalty overflows to infinity, and a distribution with infinite logits is no distribution."""


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TriedecError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen. The defaults are greedy decoding.

    * ``temperature`` >= 0: 0 = greedy (the argmax after the repetition penalty); > 0 = sampling;
      a temperature so small that ``logits / temperature`` overflows float32 (below ~1e-37) is the
      limit of sampling as it goes to 0: greedy's token (:func:`process`);
    * ``top_k`` >= 0: keep the k most likely tokens (ties at the k-th kept); 0 = off;
    * ``top_p`` in (0, 1]: keep the most likely tokens whose mass reaches top_p; 1 = off;
    * ``min_p`` in [0, 1]: drop tokens less likely than min_p x the top token's probability; 0 = off;
    * ``repetition_penalty`` in [1e-6, 1e6] (:data:`PENALTY_RANGE`): the logit of every token
      already in the prefix (prompt included) is divided by it if positive, multiplied if negative
      (transformers' CTRL penalty); 1 = off;
    * ``seed``: an integer in [0, 2**64), or None (the API then draws one and reports it).

    Unlike ``model.generate``, nothing comes from the model's generation config: a parameter left
    at its default is off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if _number("temperature", self.temperature) < 0:
            raise TriedecError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise TriedecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < _number("top_p", self.top_p) <= 1:
            raise TriedecError(f"top_p must lie in (0, 1] (1 = off), got {self.top_p!r}")
        if not 0 <= _number("min_p", self.min_p) <= 1:
            raise TriedecError(f"min_p must lie in [0, 1] (0 = off), got {self.min_p!r}")
        low, high = PENALTY_RANGE
        if not low <= _number("repetition_penalty", self.repetition_penalty) <= high:
            raise TriedecError(f"repetition_penalty must lie in [{low:g}, {high:g}] (1 = off; beyond, float32 logits "
                               f"overflow), got {self.repetition_penalty!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED):
            raise TriedecError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")

    @property
    def greedy(self) -> bool:
        """True for greedy decoding (``temperature == 0``)."""
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """True when the processing changes nothing that greedy decoding sees: greedy without a
        repetition penalty (what beam search, which applies no processors, accepts)."""
        return self.greedy and self.repetition_penalty == 1.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


SAMPLING_FIELDS = tuple(f.name for f in fields(Sampling))
"""The sampling parameters' names (transformers' names; the server's request fields too)."""

GREEDY_SAMPLING = Sampling()
"""The defaults: greedy decoding."""


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty on one row ``[V]``: the logits of the token ids ``seen``
    (any order, repeats allowed) divided by ``penalty`` where positive, multiplied where negative.
    Returns a new tensor; ``logits`` is not mutated."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    scores = logits[seen]
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(0, seen, scores)


def process(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One row of next-token logits ``[V]`` processed as transformers' sampling does, in its order:
    repetition penalty (over ``seen``, the token ids of this row's own prefix), temperature,
    top-k, top-p, min-p. Filtered tokens get ``-inf``. Returns a new float32 tensor.

    A temperature so small that the scaled logits overflow (their maximum is not finite) gives the
    limit of the distribution as the temperature goes to 0: all mass on the greedy token (the
    first argmax), every other token ``-inf``."""
    row = penalize(logits.float(), seen, sampling.repetition_penalty)
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


def draw(logits: torch.Tensor, u: float) -> int:
    """Inverse-CDF sampling from ``softmax(logits)`` (one row ``[V]``, ``-inf`` = excluded) with the
    uniform number ``u``: the first token id, in id order, whose cumulative probability exceeds
    ``u``. Computed in float64 on the CPU, so the draw does not depend on the device."""
    probs = torch.softmax(logits.detach().to("cpu", torch.float64), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    token = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    if token >= cdf.numel():  # u * total rounded up to the total: the last token with mass
        token = int(torch.nonzero(probs).max())
    return token


def seen_tokens(context: Sequence[int], extra: Sequence[int] = ()) -> torch.Tensor:
    """The token ids of a prefix (``context`` then ``extra``) as a long tensor, for :func:`process`."""
    return torch.tensor([*context, *extra], dtype=torch.long)
