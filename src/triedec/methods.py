"""Every decoding method behind one front door.

A method is a name, a frozen options class, what must be measured before it is built, and a
builder ``(options, ModelInfo) -> Decoder``. Every registered drafter is a method whose requests
join the engine's shared forward (:class:`~triedec.request.Request`); ``beam`` is trie beam
search, which verifies all its beams in one forward of its own (:class:`~triedec.engine.SoloRun`,
run beside the batch). Callers (the API, the CLI, the benchmark, the server) look a method up,
build it once and call ``decoder.start(...)`` for each request; none of them branches on which
method it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from triedec.accept import acceptance_rule
from triedec.beam import METHOD as BEAM
from triedec.beam import BeamOptions, beam_search, check_request, kv_slots
from triedec.drafters import Drafter, MethodSpec, ModelInfo, drafter_specs
from triedec.drafters.learned import Learned
from triedec.engine import Run, SoloRun
from triedec.errors import TriedecError
from triedec.request import Outcome, Request, StopRule
from triedec.sampling import GREEDY_SAMPLING, Sampling
from triedec.trace import StepTrace


class Decoder(Protocol):
    """A built method. ``start`` validates its arguments and returns the request's
    :class:`~triedec.engine.Run`, which an engine :class:`~triedec.engine.Batch` decodes; its
    ``outcome`` is an :class:`~triedec.request.Outcome`. A decoder is shared by every request of its
    (method, options); per-request state lives in the run. ``sampling`` says how tokens are chosen
    (greedy by default; sampling needs its seed set). ``export_learned`` / ``absorb_learned``
    exchange its learned state with other replicas (:mod:`triedec.drafters.learned`);
    ``max_learned_bytes`` bounds the memory that state can take (:mod:`triedec.decoders`)."""

    def start(self, prompt: Sequence[int], stop: StopRule, documents: Sequence[Sequence[int]] = (),
              sampling: Sampling = GREEDY_SAMPLING) -> Run: ...

    def export_learned(self) -> Learned: ...

    def absorb_learned(self, learned: Learned) -> None: ...

    def max_learned_bytes(self) -> int: ...


class SpeculativeDecoder:
    """A drafter whose requests run the propose -> verify -> accept -> commit step, greedy or
    sampling, in the engine's shared forward."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def start(self, prompt: Sequence[int], stop: StopRule, documents: Sequence[Sequence[int]] = (),
              sampling: Sampling = GREEDY_SAMPLING) -> Run:
        return Request(self.drafter, prompt, stop, documents, acceptance_rule(sampling))

    def export_learned(self) -> Learned:
        return self.drafter.export_learned()

    def absorb_learned(self, learned: Learned) -> None:
        self.drafter.absorb_learned(learned)

    def max_learned_bytes(self) -> int:
        return self.drafter.max_learned_bytes()


class BeamSearchDecoder:
    """Trie beam search with fixed :class:`~triedec.beam.BeamOptions`, in a loop of its own (all
    beams in one forward already). It applies no logits processors, so it refuses sampling and the
    repetition penalty."""

    def __init__(self, options: BeamOptions, model: ModelInfo) -> None:
        del model
        self.options = options

    def start(self, prompt: Sequence[int], stop: StopRule, documents: Sequence[Sequence[int]] = (),
              sampling: Sampling = GREEDY_SAMPLING) -> Run:
        if not sampling.plain:
            raise TriedecError("beam search does not sample and applies no repetition penalty: use temperature=0 "
                               "and repetition_penalty=1 with method 'beam'")
        ids = check_request(prompt, stop, documents)
        reserve = kv_slots(len(ids), self.options.num_beams, stop.max_new_tokens)  # what its trie may grow to

        def loop(adapter: Any, steps: list[StepTrace] | None) -> Any:
            result = yield from beam_search(adapter, ids, self.options, stop, steps=steps)
            return Outcome(result.stats, result.hypotheses)

        return SoloRun(loop, reserve)

    def export_learned(self) -> Learned:
        """Beam search learns nothing across requests."""
        return Learned()

    def absorb_learned(self, learned: Learned) -> None:
        """Nothing to merge."""

    def max_learned_bytes(self) -> int:
        """Nothing learned across requests."""
        return 0


GREEDY = "greedy"
BEAM_SEARCH = "beam-search"


@dataclass(frozen=True)
class Method:
    """A decoding method: ``spec`` gives its name, options (parsing, validation, defaults) and
    what it needs measured; ``build(options, model)`` makes its :class:`Decoder`; ``equals`` is
    its exactness contract: the stock transformers decoding whose output it reproduces
    (:data:`GREEDY` for every speculative method, :data:`BEAM_SEARCH` for ``beam``)."""

    spec: MethodSpec
    build: Callable[[Any, ModelInfo], Decoder]
    equals: str = GREEDY

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def description(self) -> str:
        return self.spec.description

    def make_options(self, values: Mapping[str, object]) -> Any:
        return self.spec.make_options(values)

    def needs(self, options: Any) -> frozenset[str]:
        return frozenset(self.spec.needs(options))


_LOOPS = {
    BEAM: Method(
        MethodSpec(BEAM, BeamOptions, BeamSearchDecoder,
                   "trie beam search: transformers' beam search results, all beams sharing one trie-shaped KV cache"),
        BeamSearchDecoder,
        BEAM_SEARCH,
    ),
}
"""Methods with a loop of their own (not a drafter in the speculative loop)."""


def _speculative(spec: MethodSpec) -> Method:
    return Method(spec, lambda options, model: SpeculativeDecoder(spec.factory(options, model)))


def methods() -> dict[str, Method]:
    """Every method by name: the registered drafters and ``beam``."""
    found = {name: _speculative(spec) for name, spec in drafter_specs().items() if name not in _LOOPS}
    return dict(sorted({**found, **_LOOPS}.items()))


def method(name: str) -> Method:
    """The method ``name``; an unknown name gets a clear error listing the others."""
    found = methods().get(name) if isinstance(name, str) else None
    if found is None:
        raise TriedecError(f"unknown method {name!r}; available: {', '.join(methods())}")
    return found
