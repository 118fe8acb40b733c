"""Settings declared once: a frozen dataclass field carries its command-line flag, its help and its
unit, and the flags are generated from the fields.

A field declared with :func:`setting` is a plain value an operator sets (a limit, a count, a time);
:func:`add_flags` adds one ``argparse`` option per such field of a class, with the field's default
(or a given instance's value) as the flag's default, shown in its help in the flag's unit;
:func:`values_of` reads the parsed flags back as the fields' values. A byte count can be set in
MiB on the command line (``scale=MIB``), where 0 means None (no cap) when the field allows None.

Pure Python (argparse only): importing it costs nothing, so ``triedec --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triedec.core.errors import TriedecError

MIB = 1 << 20


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line: ``help`` (without the default, which is added),
    ``flag`` (default ``--`` + the field name with dashes) and ``aliases``; ``kind`` (int, float or
    str; default: the type of the field's default); ``scale`` (the field's value is the flag's
    times ``scale``, e.g. :data:`MIB`) and ``unit`` (shown after the default); ``none``: what None
    means (shown as the default when the default is None; with a ``scale``, 0 on the command line
    is None); ``choices``."""

    help: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    kind: type | None = None
    scale: int = 1
    unit: str = ""
    none: str | None = None
    choices: tuple[str, ...] | None = None
    group: str = ""
    """the help section it is listed in (a name :func:`add_flags` is given a group for)"""


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            **flag: Any) -> Any:
    """A dataclass field with a :class:`Flag` (``flag`` holds its keyword arguments)."""
    return field(default=default, default_factory=default_factory, metadata={"flag": Flag(**flag)})


def flagged(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of ``cls`` declared with :func:`setting`, in order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def flag_name(f: dataclasses.Field, spec: Flag) -> str:
    return spec.flag or "--" + f.name.replace("_", "-")


def _shown(value: Any, spec: Flag) -> Any:
    """A field's value as the flag gives it."""
    if value is None:
        return 0 if spec.scale != 1 else None
    return value // spec.scale if spec.scale != 1 else value


def add_flags(parser: Any, cls: type, defaults: Any = None, groups: Mapping[str, Any] | None = None) -> None:
    """One option per :func:`setting` field of ``cls`` on ``parser`` (a parser or an argument group),
    or on ``groups[flag.group]`` where given; defaults from ``defaults`` (an instance of ``cls``) or
    the fields' own. Each option's ``dest`` is the field's name."""
    for f, spec in flagged(cls):
        where = (groups or {}).get(spec.group, parser)
        value = getattr(defaults, f.name) if defaults is not None else (
            f.default if f.default is not dataclasses.MISSING else f.default_factory())  # type: ignore[misc]
        shown = _shown(value, spec)
        kind = spec.kind or (type(shown) if shown is not None else str)
        if value is None and spec.none:
            default_text = f"{shown}: {spec.none}" if spec.scale != 1 else spec.none
        else:
            default_text = f"{shown}{' ' + spec.unit if spec.unit and spec.scale == 1 else ''}"
            if spec.scale != 1 and spec.none:
                default_text += f"; 0 = {spec.none}"
        names = [flag_name(f, spec), *spec.aliases]
        if kind is bool:
            where.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=shown,
                                help=f"{spec.help} (default {'on' if shown else 'off'})")
            continue
        where.add_argument(*names, dest=f.name, type=kind, default=shown, choices=spec.choices,
                            metavar=None if spec.choices else names[0].lstrip("-").replace("-", "_").upper(),
                            help=f"{spec.help} (default {default_text})")


def values_of(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The :func:`setting` fields of ``cls`` found in ``values`` (parsed flags by ``dest``), as
    the fields' values (scaled; 0 is None where a scaled field allows None)."""
    out: dict[str, Any] = {}
    for f, spec in flagged(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if spec.scale != 1 and isinstance(value, int) and value < 0:
            raise TriedecError(f"{flag_name(f, spec)} must be >= 0, got {value}")
        if spec.scale != 1 and value is not None:
            value = None if value == 0 and spec.none else value * spec.scale
        out[f.name] = value
    return out


def at_most(limit: int) -> Mapping[str, object]:
    """Field metadata of an option that sizes memory or work (``k: int = field(default=8,
    metadata=at_most(64))``): a larger value is refused wherever options are made
    (:meth:`~triedec.drafters.registry.MethodSpec.make_options`: the API, the CLI, a server request's
    ``method_options``), and ``triedec methods`` shows the bound. No request can make a drafter hold more than its
    options' maxima allow."""
    return types.MappingProxyType({"maximum": limit})
