"""What a drafter learned, as one value that replicas of one model exchange (the server's shared
learning, :mod:`triedec.server.sharing`), and the rule that merges each part.

A drafter's learned state has three kinds of parts; each has its own merge rule:

* ``outputs`` -- finished requests' outputs, each after the end of its prompt (auto's store). A
  replica adds another's outputs to its own store as if they had finished here: the store's bound
  evicts the oldest, and an output the store holds already is not kept twice.
* ``rows`` -- rows of a recycling matrix (token -> the model's top-k next tokens last seen after
  it). Last writer wins per row: a replica takes another's row unless it wrote that row itself
  since its own last export.
* ``rates`` -- rates kept as two moving averages (:class:`~triedec.drafters.estimate.MovingRatio`:
  agreement, acceptance), each sent with the updates it had since the sender's last export. A
  replica blends each into its own as a weighted average of the two averages, weighted by those
  update counts (its own at least 1): :meth:`MovingRatio.blend`.

A drafter's ``export_learned()`` returns what it learned *here* since its last export (outputs
finished here, rows written here, rates with updates here); ``absorb_learned(learned)`` merges
what another replica exported. Pure: no I/O; JSON in and out (:meth:`Learned.to_json`,
:meth:`Learned.from_json`, which refuses anything malformed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from triedec.core.errors import TriedecError

Output = tuple[tuple[int, ...], tuple[int, ...]]
"""(lead, output): the last tokens of a request's prompt and what the model answered"""
Row = tuple[int, tuple[int, ...]]
"""(token, the top-k next tokens last seen after it)"""
Rate = tuple[Hashable, float, float, int]
"""(key, numerator average, denominator average, updates since the sender's last export)"""


@dataclass(frozen=True)
class Learned:
    """What one drafter learned on one replica since its last export (module doc). Validated on
    construction (token ids are checked against a vocabulary by :meth:`check_tokens`)."""

    outputs: tuple[Output, ...] = ()
    rows: tuple[Row, ...] = ()
    rates: tuple[Rate, ...] = ()

    def __post_init__(self) -> None:
        for lead, output in self.outputs:
            _tokens("an output", lead)
            _tokens("an output", output)
        for token, row in self.rows:
            _tokens("a matrix row", (token, *row))
        for rate in self.rates:
            if len(rate) != 4:
                raise TriedecError("malformed learned state: a rate needs (key, numerator, denominator, updates)")
            _, numerator, denominator, updates = rate
            if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                       for x in (numerator, denominator)) or denominator <= 0 or numerator < 0:
                raise TriedecError("malformed learned state: a rate's averages must be finite, "
                                   "the denominator positive")
            if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
                raise TriedecError("malformed learned state: a rate's update count must be an integer >= 0")

    def __bool__(self) -> bool:
        return bool(self.outputs or self.rows or self.rates)

    def check_tokens(self, vocab_size: int) -> None:
        """Refuse a token id outside ``[0, vocab_size)`` (another model's state)."""
        tokens = [t for lead, out in self.outputs for t in (*lead, *out)]
        tokens += [t for token, row in self.rows for t in (token, *row)]
        if any(t >= vocab_size for t in tokens):
            raise TriedecError(f"learned state holds token ids beyond this model's vocabulary ({vocab_size})")

    def to_json(self) -> str:
        return json.dumps({"outputs": [[list(lead), list(out)] for lead, out in self.outputs],
                           "rows": [[token, list(row)] for token, row in self.rows],
                           "rates": [[_plain(key), num, den, n] for key, num, den, n in self.rates]},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Learned:
        """The value :meth:`to_json` wrote; anything else raises :class:`~triedec.core.errors.TriedecError`
        (keys come back with their lists as tuples)."""
        try:
            data = json.loads(text)
            outputs = tuple((tuple(lead), tuple(out)) for lead, out in data["outputs"])
            rows = tuple((token, tuple(row)) for token, row in data["rows"])
            rates = tuple((_hashable(key), num, den, n) for key, num, den, n in data["rates"])
        except (ValueError, TypeError, KeyError) as exc:
            raise TriedecError(f"malformed learned state: {exc}") from exc
        return cls(outputs, rows, rates)


def _tokens(what: str, tokens: Sequence[Any]) -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise TriedecError(f"malformed learned state: {what} must hold token ids (integers >= 0)")


def _plain(key: Hashable) -> Any:
    return [_plain(k) for k in key] if isinstance(key, tuple) else key


def _hashable(key: Any) -> Hashable:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    if isinstance(key, dict):
        raise TypeError("a rate key cannot be an object")
    return key
