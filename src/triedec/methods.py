"""Every decoding method behind one front door.

A method is a name, a frozen options class, what must be measured before it is built, and a
builder ``(options, ModelInfo) -> Decoder``. Every registered drafter is a method run by the
speculative loop (:func:`~triedec.engine.speculative_decode`); ``beam`` is trie beam search
(:func:`~triedec.beam.beam_search`). Callers (the API, the CLI, the benchmark) look a method up,
build it once and call ``decoder.decode(...)``; none of them branches on which method it is.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from triedec.accept import acceptance_rule
from triedec.adapter import ModelAdapter
from triedec.beam import METHOD as BEAM
from triedec.beam import BeamOptions, Hypothesis, beam_search
from triedec.drafters import Drafter, MethodSpec, ModelInfo, drafter_specs
from triedec.engine import Stats, StopRule, speculative_decode
from triedec.errors import TriedecError
from triedec.sampling import GREEDY_SAMPLING, Sampling


@dataclass(frozen=True)
class Outcome:
    """What a finished decode returns: its stats and, for methods that rank several sequences
    (beam search), the best ones with their scores, best first."""

    stats: Stats
    sequences: tuple[Hypothesis, ...] = ()


class Decoder(Protocol):
    """A built method. ``decode`` validates its arguments before returning the generator, which
    yields new token ids as they are committed and returns an :class:`Outcome`. A decoder is
    shared by every request of its (method, options); per-request state lives inside ``decode``.
    ``sampling`` says how tokens are chosen (greedy by default; sampling needs its seed set)."""

    def decode(self, adapter: ModelAdapter, prompt: Sequence[int], stop: StopRule,
               documents: Sequence[Sequence[int]] = (), sampling: Sampling = GREEDY_SAMPLING,
               ) -> Generator[list[int], None, Outcome]: ...


class SpeculativeDecoder:
    """A drafter run by the propose -> verify -> accept -> commit loop, greedy or sampling."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def decode(self, adapter: ModelAdapter, prompt: Sequence[int], stop: StopRule,
               documents: Sequence[Sequence[int]] = (), sampling: Sampling = GREEDY_SAMPLING,
               ) -> Generator[list[int], None, Outcome]:
        rule = acceptance_rule(sampling)
        return _outcome(speculative_decode(adapter, self.drafter, prompt, stop, documents, rule))


class BeamSearchDecoder:
    """Trie beam search with fixed :class:`~triedec.beam.BeamOptions`. It applies no logits
    processors, so it refuses sampling and the repetition penalty."""

    def __init__(self, options: BeamOptions, model: ModelInfo) -> None:
        del model
        self.options = options

    def decode(self, adapter: ModelAdapter, prompt: Sequence[int], stop: StopRule,
               documents: Sequence[Sequence[int]] = (), sampling: Sampling = GREEDY_SAMPLING,
               ) -> Generator[list[int], None, Outcome]:
        if not sampling.plain:
            raise TriedecError("beam search does not sample and applies no repetition penalty: use temperature=0 "
                               "and repetition_penalty=1 with method 'beam'")
        return _ranked(beam_search(adapter, prompt, self.options, stop, documents))


def _outcome(steps: Generator[list[int], None, Stats]) -> Generator[list[int], None, Outcome]:
    return Outcome((yield from steps))


def _ranked(steps: Generator[list[int], None, Any]) -> Generator[list[int], None, Outcome]:
    result = yield from steps
    return Outcome(result.stats, result.hypotheses)


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
