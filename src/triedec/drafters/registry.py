"""The method registry: each method's name, frozen options class (parsed from text for the CLI,
validated, bounded), factory, what it needs measured before it is built, which loop runs it and
whose output it reproduces, plus the calibrated profiles a method may declare.

Registering a drafter is one decorator on its class, with a frozen options dataclass whose
``__post_init__`` validates the values::

    @register("repeat-last", RepeatOptions, "drafts the last token again")
    class RepeatLast(BaseDrafter): ...

A method with a loop of its own (beam search, :mod:`triedec.engine.beam`) registers the same way with
``own_loop=True``: its factory builds the whole decoder (:class:`triedec.engine.methods.Decoder`)
instead of a drafter for the speculative loop.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError
from triedec.drafters.base import Drafter, ModelInfo

GREEDY = "greedy"
"""The exactness contract of a method whose output is greedy (or sampled) autoregressive decoding's."""
BEAM_SEARCH = "beam-search"
"""The exactness contract of a method whose output is transformers' beam search's."""

NEEDS_COST = "cost"
"""What a method may need measured before it is built: the device's cost curve (``ModelInfo.cost``).
Any other name asks for that method's calibrated profile (``ModelInfo.profiles[name]``)."""


STATE_FILE = types.MappingProxyType({"state_file": True})
"""Field metadata of an option that names a file of learned state kept across requests
(``store: str = field(default="", metadata=STATE_FILE)``): tools that must start from no learned
state (the benchmark's ``cold`` protocol) find such options through it."""



# ---- calibration profiles -----------------------------------------------------------------------


class CalibrationBench(Protocol):
    """What a drafter's profile measurement may use (given by :mod:`triedec.api.calibration`): the
    model's :class:`ModelInfo` with the device's cost model, calibration prompts (never benchmark
    prompts) as token ids, and ``decode(drafter, prompt, max_new_tokens)``, which decodes one
    prompt greedily with ``drafter`` and returns the tokens generated."""

    info: ModelInfo

    def prompts(self, count: int) -> list[list[int]]: ...

    def decode(self, drafter: Drafter, prompt: Sequence[int], max_new_tokens: int) -> int: ...


@dataclass(frozen=True)
class ProfileSpec:
    """A calibrated, method-specific profile a drafter declares (``register(..., profile=...)``):
    ``measure(bench)`` measures it, ``dump``/``load`` turn it into JSON values and back (``load``
    raises :class:`~triedec.core.errors.TriedecError` on bad data), ``describe(profile, cost)`` gives
    lines for ``triedec calibrate`` to print."""

    measure: Callable[[CalibrationBench], Any]
    dump: Callable[[Any], dict[str, Any]]
    load: Callable[[Mapping[str, Any]], Any]
    describe: Callable[[Any, CostModel], list[str]] = field(default=lambda profile, cost: [])


# ---- options ----------------------------------------------------------------------------------


def _field_types(options: type) -> dict[str, tuple[type, ...]]:
    """Each option's accepted value types from its annotation (``float | None`` -> (float, None))."""
    hints = typing.get_type_hints(options)
    out = {}
    for f in dataclasses.fields(options):
        hint = hints.get(f.name, str)
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
            else (hint,)
        out[f.name] = tuple(type(None) if a is type(None) else a for a in args)
    return out


def parse_option_text(text: str, kinds: tuple[type, ...]) -> object:
    """Read an option given as text (a CLI flag, a ``name:key=value`` bench entry) as one of
    ``kinds`` (tried in the order bool, int, float, str; ``none`` or ``auto`` read as None where
    None is allowed)."""
    lowered = text.strip().lower()
    if type(None) in kinds and lowered in ("none", "auto"):
        return None
    if bool in kinds:
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                pass
    if str in kinds:
        return text
    names = " or ".join("none" if k is type(None) else k.__name__ for k in kinds)
    raise TriedecError(f"cannot read {text!r} as {names}")


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: name, options class, factory ``(options, model) -> Drafter`` (with
    ``own_loop``: ``-> Decoder``, a method that runs a loop of its own), and ``needs(options)``:
    what must be measured before the factory runs (:data:`NEEDS_COST`, or a method name whose
    calibrated profile is wanted). ``equals`` is its exactness contract: the stock decoding whose
    output it reproduces (:data:`GREEDY` or :data:`BEAM_SEARCH`)."""

    name: str
    options: type
    factory: Callable[[Any, ModelInfo], Any]
    description: str
    needs: Callable[[Any], frozenset[str]] = field(default=lambda options: frozenset())
    profile: ProfileSpec | None = None
    """the calibrated profile this method can need (``needs`` then names the method itself)"""
    own_loop: bool = False
    """whether the factory builds a whole decoder with a loop of its own, not a drafter"""
    equals: str = GREEDY

    def option_defaults(self) -> dict[str, object]:
        return {f.name: f.default for f in dataclasses.fields(self.options)}

    def state_files(self, options: Mapping[str, object]) -> list[str]:
        """The options among ``options`` (name -> value) that name a learned-state file (fields
        marked with :data:`STATE_FILE`) and are set."""
        marked = {f.name for f in dataclasses.fields(self.options) if f.metadata.get("state_file")}
        return sorted(name for name, value in options.items() if name in marked and value)

    def describe(self) -> list[dict[str, object]]:
        """Each option a client may set (learned-state files left out: those are the operator's)
        as JSON: ``name``, ``type`` (its annotation), ``default`` (None: decided by the method) and
        ``maximum`` where it has one (what ``triedec methods`` lists; the playground's form)."""
        maxima = self.maxima()
        return [{"name": f.name, "type": str(f.type), "default": f.default, "maximum": maxima.get(f.name)}
                for f in dataclasses.fields(self.options) if not f.metadata.get("state_file")]

    def maxima(self) -> dict[str, int]:
        """The options that size memory or work, with their largest allowed values
        (:func:`~triedec.core.settings.at_most`)."""
        return {f.name: f.metadata["maximum"] for f in dataclasses.fields(self.options) if "maximum" in f.metadata}

    def make_options(self, values: Mapping[str, object]) -> Any:
        """The validated options object; unknown names and values over an option's maximum
        (:meth:`maxima`) get a clear error."""
        known = self.option_defaults()
        unknown = sorted(set(values) - set(known))
        if unknown:
            valid = ", ".join(known) or "none"
            raise TriedecError(f"unknown option(s) {unknown} for method {self.name!r}; valid options: {valid}")
        options = self.options(**values)
        for name, limit in self.maxima().items():
            value = getattr(options, name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > limit:
                raise TriedecError(f"method {self.name!r}: {name} may be at most {limit} (it sizes memory or work per "
                                   f"request), got {value!r}")
        return options

    def parse_options(self, texts: Mapping[str, str]) -> dict[str, object]:
        """Option values given as text (``{"num_tokens": "16"}``), read as each option's type;
        ``-`` in names is read as ``_``. The one parser behind CLI flags and bench entries."""
        kinds = _field_types(self.options)
        out: dict[str, object] = {}
        for key, text in texts.items():
            name = key.replace("-", "_")
            if name not in kinds:
                self.make_options({name: None})  # raises the standard unknown-option error
            try:
                out[name] = parse_option_text(text, kinds[name])
            except TriedecError as exc:
                raise TriedecError(f"method {self.name!r}, option {name}: {exc}") from exc
        return out


_REGISTRY: dict[str, MethodSpec] = {}
_RESERVED: dict[str, str] = {}  # option name -> the keyword form that takes it for itself


def reserve_option_names(names: Iterable[str], by: str) -> None:
    """Declare ``names`` as the keyword arguments of a keyword form above the registry (``by``:
    ``GenerationRequest.of``, ``LM.generate``, ...), which hands every other keyword to the method
    as an option: no method option may take one of them, or that form could not pass it. Checked
    now against every registered method, and at :func:`register` for every later one. The forms
    declare their own signatures (:func:`keyword_names`), so nothing here lists them by hand."""
    for name in names:
        _RESERVED.setdefault(name, by)
    for spec in _REGISTRY.values():
        _check_option_names(spec.name, spec.options)


def reserved_option_names() -> dict[str, str]:
    """Every reserved name, with the keyword form that takes it (:func:`reserve_option_names`)."""
    return dict(_RESERVED)


def keyword_names(fn: Callable[..., Any], *leave: str) -> set[str]:
    """The named parameters of ``fn`` (its ``**kwargs`` and ``self``/``cls`` aside), less ``leave``."""
    import inspect

    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.kind is not p.VAR_KEYWORD and p.name not in {"self", *leave}}


def _check_option_names(name: str, options: type) -> None:
    clash = sorted(set(_RESERVED) & {f.name for f in dataclasses.fields(options)})
    if clash:
        forms = sorted({_RESERVED[c] for c in clash})
        raise TriedecError(f"method {name!r}: option name(s) {clash} are generation arguments of "
                           f"{', '.join(forms)}; rename them")


def register(name: str, options: type, description: str,
             needs: Callable[[Any], frozenset[str]] | None = None,
             profile: ProfileSpec | None = None, own_loop: bool = False,
             equals: str = GREEDY) -> Callable[[Callable], Callable]:
    """Class/function decorator that registers a method's factory under ``name``: a drafter's
    (``(options, ModelInfo) -> Drafter``), or with ``own_loop`` a whole decoder's. ``needs``
    (default: nothing) maps an options value to what must be measured before building it
    (:data:`NEEDS_COST`, or ``name`` itself for the method's own calibrated ``profile``);
    ``equals`` is its exactness contract (:class:`MethodSpec`)."""

    def wrap(factory: Callable) -> Callable:
        if name in _REGISTRY:
            raise TriedecError(f"method {name!r} is already registered")
        if equals not in (GREEDY, BEAM_SEARCH):
            raise TriedecError(f"method {name!r}: equals must be {GREEDY!r} or {BEAM_SEARCH!r}, got {equals!r}")
        _check_option_names(name, options)
        extra = {} if needs is None else {"needs": needs}
        _REGISTRY[name] = MethodSpec(name, options, factory, description, **extra, profile=profile,
                                     own_loop=own_loop, equals=equals)
        return factory

    return wrap


def method_spec(name: str) -> MethodSpec | None:
    """The registered method ``name`` (a drafter, or a method with its own loop), or None."""
    return _REGISTRY.get(name)


def profile_specs() -> dict[str, ProfileSpec]:
    """Every registered profile by the name of the method that declares it."""
    return {name: spec.profile for name, spec in sorted(_REGISTRY.items()) if spec.profile is not None}


def method_specs() -> dict[str, MethodSpec]:
    """All registered methods by name (drafters, and methods with their own loop: ``own_loop``)."""
    return dict(sorted(_REGISTRY.items()))


@dataclass(frozen=True)
class NoOptions:
    """A method without options."""
