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
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from triedec.accept import Acceptance
from triedec.errors import TriedecError
from triedec.tree import TokenTree


@dataclass(frozen=True)
class ModelInfo:
    """What a drafter may know about the target model: nothing about its internals."""

    vocab_size: int
    device: torch.device


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
    """Model-free draft proposer.

    * ``begin(prompt, documents)`` -- a new request starts (per-request state is reset here;
      state meant to outlive requests, such as a hot-started table, is kept);
    * ``propose(context)`` -- a tree rooted at ``context[-1]`` (context = prompt + generated);
    * ``observe(verified)`` -- what the model computed for that tree (online drafters learn here).
    """

    def begin(self, prompt: Sequence[int], documents: Sequence[Sequence[int]] = ()) -> None: ...

    def propose(self, context: Sequence[int]) -> TokenTree: ...

    def observe(self, verified: Verified) -> None: ...


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
