"""Method options on the command line: ``--METHOD-OPTION VALUE`` for every registered method's
options, read generically. A command that takes them keeps each flag it does not declare as text
(:func:`split_method_flags`), and the registry reads them when the command runs
(:func:`given_options`, :func:`method_options`), so that ``--help`` needs no registry (which
imports torch)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from triedec.core.errors import TriedecError


def option_flags(method_name: str, options: type, option: str) -> list[str]:
    """``--METHOD-OPTION``, plus the short alias the options class declares (``CLI_ALIASES``)."""
    aliases = getattr(options, "CLI_ALIASES", {})
    return [f"--{method_name}-{option.replace('_', '-')}", *([aliases[option]] if option in aliases else [])]


METHOD_OPTIONS_HELP = (
    "--METHOD-OPTION VALUE sets an option of the method --method names, for example --pld-max-ngram 4 or "
    "--recycling-nodes 40 (beam's --num-beams and lookahead's --verify are short aliases); `triedec methods` lists "
    "every method's options with their defaults and maxima. An option of another method is refused.")


def add_method_options(parser: argparse.ArgumentParser) -> None:
    """Mark ``parser``'s command as taking method options: every flag it does not declare is kept
    as a method option's text (:func:`parse_command_line`) and read against the method registry
    when the command runs (:func:`given_options`). Declared generically, so that ``--help`` needs
    no registry (which imports torch)."""
    parser.add_argument_group("method options (see `triedec methods`)", METHOD_OPTIONS_HELP)
    parser.set_defaults(method_flags=())


def takes_method_options(command: argparse.ArgumentParser) -> bool:
    return command.get_default("method_flags") is not None


def split_method_flags(command: argparse.ArgumentParser,
                       tokens: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """``tokens`` (a command's arguments) split into those ``command`` declares and the method
    options' ``(flag, text)`` pairs in the order given: a ``--flag`` the command does not declare
    (nor abbreviates), with its value (``--flag=VALUE`` or the next token). ``--`` ends the flags."""
    known = [s for action in command._actions for s in action.option_strings if s.startswith("--")]
    kept: list[str] = []
    flags: list[tuple[str, str]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            kept += tokens[i:]
            break
        name, has_value, value = token.partition("=")
        if not name.startswith("--") or any(k.startswith(name) for k in known):
            kept.append(token)
        else:
            if not has_value:
                if i + 1 == len(tokens):
                    command.error(f"argument {name}: expected one argument (a method option takes a value)")
                i += 1
                value = tokens[i]
            flags.append((name, value))
        i += 1
    return kept, flags


def option_table() -> dict[str, tuple[str, str]]:
    """Every method option's flags (``--METHOD-OPTION`` and its alias) -> (method, option)."""
    from triedec.engine.methods import methods

    table: dict[str, tuple[str, str]] = {}
    for name, found in methods().items():
        for field in dataclasses.fields(found.spec.options):
            for flag in option_flags(name, found.spec.options, field.name):
                table[flag] = (name, field.name)
    return table


def given_options(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """The method-option flags given, as text: ``{method: {option: text}}``; a flag that names no
    method option is refused (:class:`~triedec.core.errors.TriedecError`); the last of two flags for one
    option wins, as with any flag."""
    flags: Sequence[tuple[str, str]] = getattr(args, "method_flags", None) or ()
    if not flags:
        return {}
    table = option_table()
    given: dict[str, dict[str, str]] = {}
    for flag, text in flags:
        if flag not in table:
            raise TriedecError(f"unrecognized argument {flag}: neither a flag of `triedec {args.command}` nor a "
                               "method option (`triedec methods` lists those)")
        owner, option = table[flag]
        given.setdefault(owner, {})[option] = text
    return given


def method_options(args: argparse.Namespace, method_name: str) -> dict[str, object]:
    """The option flags given for ``method_name``, parsed; flags of other methods are refused."""
    from triedec.engine.methods import method

    given = given_options(args)
    for owner, options in given.items():
        if owner != method_name:
            flag = option_flags(owner, method(owner).spec.options, next(iter(options)))[-1]
            raise TriedecError(f"{flag} is an option of method {owner!r}, not {method_name!r}")
    return method(method_name).spec.parse_options(given.get(method_name, {}))
