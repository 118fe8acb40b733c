"""The drafter protocol, per-request sessions, the option parser and the drafter registry.

A drafter is model-free: it sees token ids (the context) and, after each verification, what the
model computed for the tree it proposed. The engine treats every drafter alike.

**Where state lives.** A drafter object is shared by every request that uses its method and
options (the :class:`~triedec.lm.LM` keeps one, so learned state stays warm); everything that
belongs to one request lives in the :class:`DrafterSession` that ``drafter.begin(...)`` returns.
State meant to outlive requests (Token Recycling's matrix, agreement rates) stays on the drafter,
and every update of it is made under the drafter's lock, so concurrent requests are safe.

Registering a drafter is one decorator on its class, with a frozen options dataclass whose
``__post_init__`` validates the values::

    @register("repeat-last", RepeatOptions, "drafts the last token again")
    class RepeatLast(BaseDrafter): ...
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from triedec.accept import Acceptance
from triedec.costmodel import CostModel
from triedec.drafters.learned import Learned
from triedec.errors import TriedecError
from triedec.tree import TokenTree

NEEDS_COST = "cost"
"""What a method may need measured before it is built: the device's cost curve (``ModelInfo.cost``).
Any other name asks for that method's calibrated profile (``ModelInfo.profiles[name]``)."""


@dataclass(frozen=True)
class ModelInfo:
    """What a drafter may know about the target model: nothing about its internals.

    ``model_id`` fingerprints the weights (to tag saved drafter state). ``cost`` is the device's
    measured cost curve, or None: size drafts as for a flat curve (every verified token free).
    ``profiles`` holds calibrated, method-specific values by method name (Token Recycling's node
    acceptance rates under ``"recycling"``). Both are measured by :mod:`triedec.calibration`
    before a drafter is built, never by the drafter.
    """

    vocab_size: int
    device: torch.device
    model_id: str = ""
    cost: CostModel | None = None
    profiles: Mapping[str, Any] = field(default_factory=dict, compare=False)


STATE_FILE = types.MappingProxyType({"state_file": True})
"""Field metadata of an option that names a file of learned state kept across requests
(``store: str = field(default="", metadata=STATE_FILE)``): tools that must start from no learned
state (the benchmark's ``cold`` protocol) find such options through it."""



def at_most(limit: int) -> Mapping[str, object]:
    """Field metadata of an option that sizes memory or work (``k: int = field(default=8,
    metadata=at_most(64))``): a larger value is refused wherever options are made
    (:meth:`MethodSpec.make_options`: the API, the CLI, a server request's ``method_options``),
    and ``triedec methods`` shows the bound. No request can make a drafter hold more than its
    options' maxima allow."""
    return types.MappingProxyType({"maximum": limit})


FROM_STORE = "accepted_from_store"
"""Key of a session's :meth:`~DrafterSession.stats`: this request's accepted draft tokens that a
store of earlier requests' outputs proposed (auto's store); drafters without one report nothing
(read as 0). The server returns it, so that whether learned state crossed requests is visible."""

MAX_TREE_NODES = 256
"""Upper bound on a verified tree's size (root included); the engine cuts larger proposals."""

SOURCES = {
    "context": "an n-gram trie over the request's own context (documents, prompt, output so far)",
    "prompt": "prompt lookup: a continuation of an earlier occurrence of the last tokens in the context",
    "recycling": "Token Recycling's adjacency matrix: the model's own earlier top-k after a token",
    "store": "auto's cross-request store: earlier outputs of this model",
    "lookahead": "lookahead decoding's n-gram pool and Jacobi window",
}
"""The draft sources the built-in drafters name in :attr:`Draft.sources`, with what each is (the
playground's legend and ``docs/`` show these). A plug-in drafter may name others."""

UNNAMED = "draft"
"""The source of a draft node whose drafter named none."""


@dataclass(frozen=True)
class Draft:
    """A proposal: a tree and each node's estimated chance of being accepted, best first.

    ``tree`` lists its nodes best first (any prefix of a tree's node list is a tree, so the engine
    can verify any prefix). ``chances[i]`` is the drafter's estimate of the probability that node
    i is accepted (the root's is 1); the allocator (:mod:`triedec.allocate`) merges every running
    request's chances and decides how long a prefix of each draft one forward verifies.
    ``required``: how many leading nodes (root included) are verified whatever the allocator
    decides: drafters with a fixed tree (lookahead) or a size the user forced (``sized=False``,
    ``nodes=80``) set it to the whole tree. ``sources[i]``: the names of the sources that drafted
    node i, primary first (see :data:`SOURCES`; the root's is empty), or ``()`` when the drafter
    names none (its nodes count as :data:`UNNAMED`): what a token accepted from node i reports as
    its origin (:mod:`triedec.trace`). Frozen and validated on construction."""

    tree: TokenTree
    chances: tuple[float, ...]
    required: int = 1
    sources: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        chances = tuple(float(c) for c in self.chances)
        object.__setattr__(self, "chances", chances)
        if len(chances) != self.tree.size:
            raise TriedecError(f"a draft of {self.tree.size} nodes needs {self.tree.size} chances, got {len(chances)}")
        if chances[0] != 1.0 or any(not 0.0 <= c <= 1.0 for c in chances):
            raise TriedecError("draft chances must lie in [0, 1], the root's being 1")
        if isinstance(self.required, bool) or not isinstance(self.required, int) \
                or not 1 <= self.required <= self.tree.size:
            raise TriedecError(f"required must be an integer in [1, {self.tree.size}], got {self.required!r}")
        sources = tuple(tuple(str(n) for n in names) for names in self.sources)
        object.__setattr__(self, "sources", sources)
        if sources and (len(sources) != self.tree.size or sources[0]):
            raise TriedecError(f"a draft of {self.tree.size} nodes needs {self.tree.size} source lists (the root's "
                               f"empty), got {len(sources)}")

    def labelled(self, source: str) -> Draft:
        """This draft with every draft node drafted by ``source`` (a drafter with one source)."""
        return dataclasses.replace(self, sources=((),) + ((source,),) * (self.size - 1))

    def sources_of(self, node: int) -> tuple[str, ...]:
        """Who drafted ``node``: its sources, :data:`UNNAMED` if the drafter named none, ``()`` for
        the root."""
        if node == 0:
            return ()
        return self.sources[node] if self.sources else (UNNAMED,)

    @classmethod
    def root_only(cls, root: int) -> Draft:
        """Nothing drafted: verifying it is one plain step."""
        return cls(TokenTree.root_only(root), (1.0,))

    @classmethod
    def fixed(cls, tree: TokenTree) -> Draft:
        """A tree verified whole, without estimates (its drafts count as chance 0 when sizing the
        rest of the forward)."""
        return cls(tree, (1.0,) + (0.0,) * (tree.size - 1), tree.size)

    @classmethod
    def scored(cls, tree: TokenTree, chances: Sequence[float], send_all: bool = False,
               sources: Sequence[Sequence[str]] = ()) -> Draft:
        """A tree with estimates; ``send_all`` makes every node required (the user forced it)."""
        return cls(tree, tuple(chances), tree.size if send_all else 1, tuple(tuple(s) for s in sources))

    @property
    def size(self) -> int:
        return self.tree.size

    def within(self, max_nodes: int, max_depth: int) -> tuple[Draft, tuple[int, ...]]:
        """This draft without its nodes deeper than ``max_depth`` and cut to ``max_nodes`` nodes:
        a smaller draft (still best first) and, for each of its nodes, its index here."""
        depths = self.tree.depths
        keep = [i for i in range(self.size) if depths[i] <= max_depth][:max_nodes]
        if len(keep) == self.size:
            return self, tuple(keep)
        index = {old: new for new, old in enumerate(keep)}
        parents = tuple(-1 if i == 0 else index[self.tree.parents[i]] for i in keep)
        tree = TokenTree(tuple(self.tree.tokens[i] for i in keep), parents)
        required = sum(1 for i in keep if i < self.required)
        sources = tuple(self.sources[i] for i in keep) if self.sources else ()
        return Draft(tree, tuple(self.chances[i] for i in keep), max(1, required), sources), tuple(keep)


@dataclass(frozen=True)
class Verified:
    """What the model computed for a proposal.

    ``tree``: the nodes that were verified, which may be fewer than proposed: the engine keeps a
    prefix of the draft that the allocator sized (and drops nodes past ``max_new_tokens``).
    ``kept[i]`` is the proposal index of verified node i; ``proposed`` is the proposal's size
    (None for both: the whole proposal was verified). ``logits``: float ``[tree.size, vocab]``,
    the model's next-token logits after every verified node (root and every draft node, accepted
    or not). ``acceptance``: the accepted path and new tokens.
    """

    tree: TokenTree
    logits: torch.Tensor
    acceptance: Acceptance
    kept: tuple[int, ...] | None = None
    proposed: int | None = None

    @property
    def cut(self) -> bool:
        """Whether fewer nodes were verified than proposed."""
        return self.proposed is not None and self.tree.size < self.proposed

    def index(self, node: int) -> int:
        """The proposal index of verified node ``node``."""
        return node if self.kept is None else self.kept[node]


@runtime_checkable
class DrafterSession(Protocol):
    """One request's drafting state. The engine calls, in this order:

    * if the drafter's ``prefill_logits`` > 0: ``observe`` with the prompt's last
      ``prefill_logits`` tokens as verified chains with their prefill logits, one per prompt chunk
      that holds some of them, in order;
    * per step, ``propose(context, max_nodes)`` -- a :class:`Draft` of at most ``max_nodes`` nodes
      rooted at ``context[-1]`` (context = prompt + generated), best first -- then
      ``observe(verified)`` -- what the model computed for the part of it that was verified
      (:class:`Verified` says which part);
    * ``end()`` -- the request is over (also when the caller stops early or the request is
      cancelled);

    and ``stats()`` for counters to report. A session is used by one request (one thread) only.
    """

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft: ...

    def observe(self, verified: Verified) -> None: ...

    def end(self) -> None: ...

    def stats(self) -> dict[str, float]: ...


@runtime_checkable
class Drafter(Protocol):
    """Model-free draft proposer shared by many requests: ``begin(prompt, documents)`` starts one
    request and returns its :class:`DrafterSession`; ``prefill_logits`` says how many of the
    prompt's last positions the session wants to observe with their prefill logits; ``persist()``
    writes the learned state to its file, if one is configured (a snapshot taken under the
    drafter's lock, written outside it; the engine decides when). ``export_learned()`` returns
    what it learned here since its last export and ``absorb_learned(learned)`` merges another
    replica's (:mod:`triedec.drafters.learned`: what is exchanged and each part's merge rule);
    a drafter that learns nothing across requests exports an empty value and absorbs nothing.
    ``max_learned_bytes()``: the most memory its learned state can ever take, from its options'
    bounds (not what it holds now): what :mod:`triedec.decoders` keeps built methods under."""

    prefill_logits: int

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> DrafterSession: ...

    def persist(self) -> None: ...

    def export_learned(self) -> Learned: ...

    def absorb_learned(self, learned: Learned) -> None: ...

    def max_learned_bytes(self) -> int: ...


class BaseSession:
    """No-op defaults for the optional parts of :class:`DrafterSession`."""

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft:
        raise NotImplementedError

    def observe(self, verified: Verified) -> None:
        """Nothing to learn."""

    def end(self) -> None:
        """Nothing to flush."""

    def stats(self) -> dict[str, float]:
        return {}


class _StatelessSession(BaseSession):
    def __init__(self, propose: Callable[[Sequence[int]], TokenTree | Draft]) -> None:
        self._propose = propose

    def propose(self, context: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> Draft:
        found = self._propose(context)
        return found if isinstance(found, Draft) else Draft.fixed(found)


class BaseDrafter:
    """A drafter without per-request state: subclasses define ``propose(context)`` (a
    :class:`Draft`, or a plain tree to be verified whole) and ``begin`` returns a session that
    calls it. Drafters with per-request state override ``begin`` to return their own
    :class:`DrafterSession`."""

    prefill_logits: int = 0

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> DrafterSession:
        return _StatelessSession(self.propose)

    def propose(self, context: Sequence[int]) -> TokenTree | Draft:
        raise NotImplementedError(f"{type(self).__name__} must define propose() or begin()")

    def persist(self) -> None:
        """No learned state to write."""

    def export_learned(self) -> Learned:
        """Nothing learned across requests."""
        return Learned()

    def absorb_learned(self, learned: Learned) -> None:
        """Nothing to merge."""

    def max_learned_bytes(self) -> int:
        """Nothing learned across requests."""
        return 0


# ---- calibration profiles -----------------------------------------------------------------------


class CalibrationBench(Protocol):
    """What a drafter's profile measurement may use (given by :mod:`triedec.calibration`): the
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
    raises :class:`~triedec.errors.TriedecError` on bad data), ``describe(profile, cost)`` gives
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
    """A registered drafter: name, options class, factory ``(options, model) -> Drafter``, and
    ``needs(options)``: what must be measured before the factory runs (:data:`NEEDS_COST`, or a
    method name whose calibrated profile is wanted)."""

    name: str
    options: type
    factory: Callable[[Any, ModelInfo], Any]
    description: str
    needs: Callable[[Any], frozenset[str]] = field(default=lambda options: frozenset())
    profile: ProfileSpec | None = None
    """the calibrated profile this method can need (``needs`` then names the method itself)"""

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
        (:func:`at_most`)."""
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
RESERVED = frozenset({"beam"})
"""Method names taken by loops other than the speculative one (see :mod:`triedec.methods`)."""
GENERATION_ARGUMENTS = frozenset({
    "prompt", "method", "max_new_tokens", "stop", "stop_token_ids", "context", "chat", "on_tokens",
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed",
})
"""Keyword arguments of ``LM.generate`` itself: no method option may take one of these names."""


def register(name: str, options: type, description: str,
             needs: Callable[[Any], frozenset[str]] | None = None,
             profile: ProfileSpec | None = None) -> Callable[[Callable], Callable]:
    """Class/function decorator that registers a drafter factory under ``name``; ``needs``
    (default: nothing) maps an options value to what must be measured before building it
    (:data:`NEEDS_COST`, or ``name`` itself for the method's own calibrated ``profile``)."""

    def wrap(factory: Callable) -> Callable:
        if name in _REGISTRY or name in RESERVED:
            raise TriedecError(f"method {name!r} is already registered")
        clash = sorted(GENERATION_ARGUMENTS & {f.name for f in dataclasses.fields(options)})
        if clash:
            raise TriedecError(f"method {name!r}: option name(s) {clash} are generation arguments; rename them")
        extra = {} if needs is None else {"needs": needs}
        _REGISTRY[name] = MethodSpec(name, options, factory, description, **extra, profile=profile)
        return factory

    return wrap


def drafter_spec(name: str) -> MethodSpec | None:
    """The registered drafter ``name``, or None."""
    return _REGISTRY.get(name)


def profile_specs() -> dict[str, ProfileSpec]:
    """Every registered profile by the name of the method that declares it."""
    return {name: spec.profile for name, spec in sorted(_REGISTRY.items()) if spec.profile is not None}


def drafter_specs() -> dict[str, MethodSpec]:
    """All registered drafters by name."""
    return dict(sorted(_REGISTRY.items()))


@dataclass(frozen=True)
class NoOptions:
    """A method without options."""
