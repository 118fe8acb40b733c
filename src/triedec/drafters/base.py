"""The drafter protocol and the method registry.

A drafter is model-free: it sees token ids (the context) and, after each verification, what the
model computed for the tree it proposed. The engine treats every drafter alike.

Registering a drafter is one decorator on its factory, with a frozen options dataclass whose
``__post_init__`` validates the values::

    @register("pld", PromptLookupOptions, "prompt lookup: ...")
    class PromptLookupDrafter: ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from triedec.accept import Acceptance
from triedec.errors import TriedecError
from triedec.tree import TokenTree

if TYPE_CHECKING:
    from triedec.calibration import Calibration


@dataclass(frozen=True)
class ModelInfo:
    """What a drafter may know about the target model: nothing about its internals.

    ``model_id`` fingerprints the weights (to tag saved drafter state); ``calibration`` returns the
    device calibration of this model (measured once and cached; see :mod:`triedec.calibration`),
    for drafters that size their trees from it.
    """

    vocab_size: int
    device: torch.device
    model_id: str = ""
    calibration: Callable[[], Calibration] | None = field(default=None, compare=False)

    def require_calibration(self) -> Calibration:
        if self.calibration is None:
            raise TriedecError("this drafter setting needs a device calibration, and none is available here")
        return self.calibration()


@dataclass(frozen=True)
class Verified:
    """What the model computed for a proposed tree.

    ``logits``: float ``[tree.size, vocab]``, the model's next-token logits after every node (root
    and every draft node, accepted or not). ``acceptance``: the accepted path and new tokens.
    """

    tree: TokenTree
    logits: torch.Tensor
    acceptance: Acceptance


@runtime_checkable
class Drafter(Protocol):
    """Model-free draft proposer. The engine calls, per request:

    * ``begin(prompt, documents)`` -- a new request starts (per-request state is reset here;
      state meant to outlive requests, such as a hot-started table, is kept);
    * if ``prefill_logits`` > 0: ``observe`` once with the prompt's last ``prefill_logits`` tokens
      as a verified chain, with their prefill logits ``[min(prefill_logits, len(prompt)), vocab]``;
    * per step, ``propose(context)`` -- a tree rooted at ``context[-1]`` (context = prompt +
      generated) -- then ``observe(verified)`` -- what the model computed for that tree;
    * ``end()`` -- the request is over (also when the caller stops early);

    and ``stats()`` for drafter-specific counters to report. :class:`BaseDrafter` supplies no-op
    defaults for everything but ``propose``.
    """

    prefill_logits: int

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> None: ...

    def propose(self, context: Sequence[int]) -> TokenTree: ...

    def observe(self, verified: Verified) -> None: ...

    def end(self) -> None: ...

    def stats(self) -> dict[str, float]: ...


class BaseDrafter:
    """No-op defaults for the optional parts of the :class:`Drafter` protocol."""

    prefill_logits: int = 0

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> None:
        """Nothing to reset."""

    def propose(self, context: Sequence[int]) -> TokenTree:
        raise NotImplementedError

    def observe(self, verified: Verified) -> None:
        """Nothing to learn."""

    def end(self) -> None:
        """Nothing to flush."""

    def stats(self) -> dict[str, float]:
        return {}


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its name, options class and a factory ``(options, model) -> Drafter``."""

    name: str
    options: type
    factory: Callable[[Any, ModelInfo], Drafter]
    description: str

    def option_defaults(self) -> dict[str, object]:
        return {f.name: f.default for f in dataclasses.fields(self.options)}

    def make_options(self, values: Mapping[str, object]) -> object:
        """Build the validated options object; unknown names get a clear error."""
        known = self.option_defaults()
        unknown = sorted(set(values) - set(known))
        if unknown:
            valid = ", ".join(known) or "none"
            raise TriedecError(f"unknown option(s) {unknown} for method {self.name!r}; valid options: {valid}")
        return self.options(**values)


def parse_option_value(text: str, default: object) -> object:
    """Read an option given as text (CLI flag, ``name:key=value``) as the type of its default."""
    kind = type(default) if default is not None else str
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise TriedecError(f"expected true or false, got {text!r}")
    try:
        return kind(text)
    except ValueError as exc:
        raise TriedecError(f"cannot read {text!r} as {kind.__name__}") from exc


_REGISTRY: dict[str, MethodSpec] = {}


def register(name: str, options: type, description: str) -> Callable[[Callable], Callable]:
    """Class/function decorator that registers a drafter factory under ``name``."""

    def wrap(factory: Callable) -> Callable:
        if name in _REGISTRY:
            raise TriedecError(f"method {name!r} is already registered")
        _REGISTRY[name] = MethodSpec(name, options, factory, description)
        return factory

    return wrap


def method_spec(name: str) -> MethodSpec:
    spec = _REGISTRY.get(name)
    if spec is None:
        raise TriedecError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return spec


def methods() -> dict[str, MethodSpec]:
    """All registered methods by name."""
    return dict(sorted(_REGISTRY.items()))


@dataclass(frozen=True)
class NoOptions:
    """A method without options."""
