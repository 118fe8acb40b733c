"""Every decoding method behind one front door.

A method is a registered :class:`~triedec.drafters.registry.MethodSpec` (a name, a frozen options
class, what must be measured before it is built, its exactness contract) and a builder
``(options, ModelInfo) -> Decoder``. Every registered drafter is a method whose requests join the
engine's shared forward (:class:`~triedec.engine.request.Request`); a method that declares a loop of its
own (``own_loop``: ``beam``, trie beam search, which verifies all its beams in one forward of its
own, :class:`~triedec.engine.runs.SoloRun`, run beside the batch) builds its decoder itself.
Callers (the API, the CLI, the benchmark, the server) look a method up, build it once and call
``decoder.start(...)`` for each request; none of them branches on which method it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import triedec.engine.beam  # noqa: F401  (registers method "beam")
from triedec.core.accept import acceptance_rule
from triedec.core.errors import TriedecError
from triedec.core.grammar import TokenConstraint
from triedec.core.logprobs import Logprobs
from triedec.core.sampling import GREEDY_SAMPLING, Sampling
from triedec.drafters import Drafter, MethodSpec, ModelInfo, method_specs
from triedec.drafters.learned import Learned
from triedec.drafters.registry import BEAM_SEARCH, GREEDY
from triedec.engine.request import Request, StopRule
from triedec.engine.runs import Run

__all__ = ["BEAM_SEARCH", "GREEDY", "Decoder", "Method", "SpeculativeDecoder", "method", "methods"]


class Decoder(Protocol):
    """A built method. ``start`` validates its arguments and returns the request's
    :class:`~triedec.engine.runs.Run`, which an engine :class:`~triedec.engine.batch.Batch` decodes; its
    ``outcome`` is an :class:`~triedec.engine.outcome.Outcome`. A decoder is shared by every request of its
    (method, options); per-request state lives in the run. ``sampling`` says how tokens are chosen
    (greedy by default; sampling needs its seed set); ``logprobs`` what to report of each token's
    probability (:class:`~triedec.core.logprobs.Logprobs`; None: nothing); ``constraint`` the
    request's grammar state (:class:`~triedec.core.grammar.TokenConstraint`; None: unconstrained).
    ``export_learned`` / ``absorb_learned`` exchange its learned state with other replicas
    (:mod:`triedec.drafters.learned`);
    ``max_learned_bytes`` bounds the memory that state can take (:mod:`triedec.api.decoders`)."""

    def start(self, prompt: Sequence[int], stop: StopRule, documents: Sequence[Sequence[int]] = (),
              sampling: Sampling = GREEDY_SAMPLING, logprobs: Logprobs | None = None,
              constraint: TokenConstraint | None = None) -> Run: ...

    def export_learned(self) -> Learned: ...

    def absorb_learned(self, learned: Learned) -> None: ...

    def max_learned_bytes(self) -> int: ...


class SpeculativeDecoder:
    """A drafter whose requests run the propose -> verify -> accept -> commit step, greedy or
    sampling, in the engine's shared forward."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def start(self, prompt: Sequence[int], stop: StopRule, documents: Sequence[Sequence[int]] = (),
              sampling: Sampling = GREEDY_SAMPLING, logprobs: Logprobs | None = None,
              constraint: TokenConstraint | None = None) -> Run:
        return Request(self.drafter, prompt, stop, documents, acceptance_rule(sampling, stop.eos_token_ids), logprobs,
                       constraint)

    def export_learned(self) -> Learned:
        return self.drafter.export_learned()

    def absorb_learned(self, learned: Learned) -> None:
        self.drafter.absorb_learned(learned)

    def max_learned_bytes(self) -> int:
        return self.drafter.max_learned_bytes()


@dataclass(frozen=True)
class Method:
    """A decoding method: ``spec`` gives its name, options (parsing, validation, defaults), what
    it needs measured and its exactness contract ``equals`` (:data:`GREEDY` for every speculative
    method, :data:`BEAM_SEARCH` for ``beam``); ``build(options, model)`` makes its :class:`Decoder`:
    the registered factory's, wrapped in the speculative loop unless the method declares a loop of
    its own (``spec.own_loop``)."""

    spec: MethodSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def description(self) -> str:
        return self.spec.description

    @property
    def equals(self) -> str:
        return self.spec.equals

    def build(self, options: Any, model: ModelInfo) -> Decoder:
        built = self.spec.factory(options, model)
        return built if self.spec.own_loop else SpeculativeDecoder(built)

    def make_options(self, values: Mapping[str, object]) -> Any:
        return self.spec.make_options(values)

    def needs(self, options: Any) -> frozenset[str]:
        return frozenset(self.spec.needs(options))


def methods() -> dict[str, Method]:
    """Every registered method by name: the drafters and ``beam``."""
    return {name: Method(spec) for name, spec in method_specs().items()}


def method(name: str) -> Method:
    """The method ``name``; an unknown name gets a clear error listing the others."""
    found = methods().get(name) if isinstance(name, str) else None
    if found is None:
        raise TriedecError(f"unknown method {name!r}; available: {', '.join(methods())}")
    return found
