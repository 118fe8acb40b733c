"""Tool calls: a request's functions and tool choice checked (OpenAI's ``tools``, ``tool_choice``
and ``parallel_tool_calls``), the model's own tool-call format found in its chat template, a
grammar that makes every call name a given function with arguments valid against its JSON schema,
and the model's output read back as calls.

A reply is either text or one or more calls, never both: the grammar lets the model begin with
the format's opening tag (a call) or with anything else (text), so a reply that begins as a call
is a call to the end.

**Formats.** A model calls tools in the format its chat template teaches it. triedec knows
:data:`HERMES` (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one per call,
a newline between calls): the format of Qwen2 / Qwen2.5 (Qwen2.5-Coder included), Hermes 2/3,
SmolLM3 and many fine-tunes. :func:`tool_format` finds it by rendering the template with a probe
tool; a template that renders no tools, or renders them in a format triedec does not know, is a
:class:`~triedec.core.errors.TriedecError` that says so.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triedec.core.errors import TriedecError
from triedec.core.grammar import Grammar

MAX_TOOLS = 128
"""The most functions one request may offer (OpenAI's own cap)."""

TOOL_CHOICES = ("none", "auto", "required")
"""``tool_choice``'s words: no call (the tools are not shown to the model), text or calls (the
default), at least one call; or ``{"type": "function", "function": {"name": ...}}``: one call of
that function."""

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How a call's arguments are laid out: as ``json.dumps`` and the chat templates' ``tojson``
write them, with no free whitespace."""


@dataclass(frozen=True)
class Function:
    """A function the model may call: its ``name`` (``[A-Za-z0-9_-]``, at most 64), what it does,
    and its ``parameters`` (a JSON schema, as JSON text)."""

    name: str
    description: str | None
    parameters: str

    def as_template(self) -> dict[str, Any]:
        """As OpenAI spells it, which is what chat templates read (``apply_chat_template(tools=)``)."""
        function: dict[str, Any] = {"name": self.name, "parameters": json.loads(self.parameters)}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: an ``id`` (``call_`` and 24 hex digits), the function's ``name``
    and its ``arguments`` as JSON text."""

    id: str
    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (``index``: a streamed delta's)."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class Tools:
    """A request's tools: the ``functions`` offered, the ``choice`` (one of :data:`TOOL_CHOICES`, or
    the name of the one function to call) and whether a reply may make several calls
    (``parallel``)."""

    functions: tuple[Function, ...]
    choice: str = "auto"
    parallel: bool = True

    @classmethod
    def of(cls, tools: object, choice: object = None, parallel: object = None) -> Tools | None:
        """Checked from OpenAI's spelling (``tools``, ``tool_choice``, ``parallel_tool_calls``);
        None when there are no tools. Raises :class:`ToolsError` naming the field at fault."""
        if tools is None or tools == []:
            if choice not in (None, "none", "auto"):
                raise ToolsError("tool_choice", "tool_choice needs tools")
            return None
        if not isinstance(tools, list):
            raise ToolsError("tools", "tools must be a list")
        if len(tools) > MAX_TOOLS:
            raise ToolsError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
        functions = tuple(_function(i, t) for i, t in enumerate(tools))
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise ToolsError("tools", "two tools have the same name")
        if parallel is not None and not isinstance(parallel, bool):
            raise ToolsError("parallel_tool_calls", "parallel_tool_calls must be true or false")
        if choice is None:
            word = "auto"
        elif isinstance(choice, str):
            if choice not in TOOL_CHOICES:
                raise ToolsError("tool_choice", f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a "
                                                f"function, got {choice!r}")
            word = choice
        elif (isinstance(choice, Mapping) and choice.get("type") == "function" and set(choice) <= {"type", "function"}
              and isinstance(choice.get("function"), Mapping) and isinstance(choice["function"].get("name"), str)):
            word = choice["function"]["name"]
            if word not in names:
                raise ToolsError("tool_choice", f"tool_choice names {word!r}, which is not among the tools")
        else:
            raise ToolsError("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                            '"function": {"name": ...}}')
        return cls(functions, word, True if parallel is None else parallel)

    @property
    def calls(self) -> bool:
        """Whether the model may call a function (``tool_choice`` is not ``none``)."""
        return self.choice != "none"

    def as_template(self) -> list[dict[str, Any]]:
        """The functions as the chat template reads them."""
        return [f.as_template() for f in self.functions]


class ToolsError(TriedecError):
    """A request's tools, badly given; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _function(i: int, tool: object) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise ToolsError("tools", f'{where} must be {{"type": "function", "function": {{...}}}}')
    spec = tool["function"]
    unknown = set(spec) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise ToolsError("tools", f"{where}.function has unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolsError("tools", f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, _ and -, got {name!r}")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolsError("tools", f"{where}.function.description must be a string")
    parameters = spec.get("parameters", _NO_PARAMETERS)
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise ToolsError("tools", f"{where}.function.parameters must be a JSON schema of an object")
    if "strict" in spec and not isinstance(spec["strict"], bool):
        raise ToolsError("tools", f"{where}.function.strict must be true or false")
    return Function(name, description, json.dumps(parameters))


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes calls: each call is ``open`` + ``{"name": NAME, "arguments": ARGS}`` +
    ``close``, calls joined by ``separator``."""

    name: str
    open: str
    close: str
    separator: str
    tokens: tuple[tuple[str, int], ...] = ()
    """the format's tags that the tokenizer holds as one added token each (Qwen2.5's
    ``<tool_call>``), with their ids: the grammar asks for that token, as the model writes it"""

    def lark(self, text: str) -> str:
        """``text`` as a Lark sequence: its tags that are added tokens as those tokens, the rest
        as string literals."""
        parts: list[str] = []
        rest = text
        while rest:
            hits = [(rest.find(tag), tag, tid) for tag, tid in self.tokens if tag in rest]
            if not hits:
                parts.append(json.dumps(rest))
                break
            at, tag, tid = min(hits)
            if at:
                parts.append(json.dumps(rest[:at]))
            parts.append(f"<[{tid}]>")
            rest = rest[at + len(tag):]
        return " ".join(parts)

    @property
    def tag(self) -> str:
        """What a reply that calls begins with (``open`` without its trailing whitespace)."""
        return self.open.rstrip()

    def grammar(self, tools: Tools, content: Grammar | None = None) -> Grammar | None:
        """The output ``tools`` allow, as a grammar (None with ``tool_choice`` ``none``): text or
        calls (``auto``), calls (``required``), one call of the named function; one call at most
        unless ``parallel``. Each call names one of the functions, with arguments valid against its
        schema. ``content`` (a ``json_schema`` or ``json_object`` grammar: the request's
        ``response_format``) is what a reply that calls nothing must be instead of any text."""
        if not tools.calls:
            return None
        if content is not None and content.kind not in ("json_schema", "json_object"):
            raise TriedecError(f"a {content.kind} grammar cannot be combined with tools; a JSON schema can")
        named = [f for f in tools.functions if f.name == tools.choice]
        one = [_call_rule(self, f) for f in (named or tools.functions)]
        rules = [f"call: {' | '.join(f'call_{i}' for i in range(len(one)))}",
                 *(f"call_{i}: {body}" for i, body in enumerate(one))]
        calls = "call" if named or not tools.parallel else f"call ({self.lark(self.separator)} call)*"
        if tools.choice == "auto" and content is not None:
            from triedec.api.grammar import JSON_OPTIONS

            schema = json.loads(content.source) if content.kind == "json_schema" else {"type": "object"}
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            schema = {**schema, "x-guidance": JSON_OPTIONS}
            start = [f"start: content | {calls}", f"content: %json {json.dumps(schema)}"]
        elif tools.choice == "auto":
            start = [f"start: TEXT | {calls}", f"TEXT: /{_not_starting_with(self.tag)}/"]
        else:
            start = [f"start: {calls}"]
        return Grammar.lark("\n".join([*start, *rules]))

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        """The calls in a reply, as (name, arguments as JSON text), or None if the reply is not
        calls (text, or calls cut short)."""
        if not text.startswith(self.tag):
            return None
        out = []
        rest = text
        while True:
            if not rest.startswith(self.open) or self.close not in rest:
                return None
            body, rest = rest[len(self.open):].split(self.close, 1)
            try:
                call = json.loads(body)
            except ValueError:
                return None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
                return None
            out.append((call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
            if not rest.strip():
                return out
            if not rest.startswith(self.separator):
                return None
            rest = rest[len(self.separator):]


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n")
"""Hermes' format (Qwen2 / Qwen2.5, Hermes 2/3, SmolLM3, ...)."""

FORMATS = (HERMES,)
"""The tool-call formats triedec knows, found by :func:`tool_format`."""

_PROBE = Function("triedec_probe_function", "A probe.", json.dumps(
    {"type": "object", "properties": {"probe_argument": {"type": "string"}}}))


def tool_format(tokenizer: Any) -> ToolFormat:
    """The tool-call format ``tokenizer``'s chat template teaches its model: it must render tools
    (a probe function's name appears in the prompt) and name a format of :data:`FORMATS`."""
    if not getattr(tokenizer, "chat_template", None):
        raise TriedecError("this model has no chat template, so it cannot be given tools")
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[_PROBE.as_template()], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:
        raise TriedecError(f"this model's chat template fails to render tools: {type(exc).__name__}: {exc}") from None
    if _PROBE.name not in text:
        raise TriedecError("this model's chat template has no tool format (it does not render tools), so the "
                           "model cannot be given tools; serve it with a --chat-template that does (see "
                           "docs/structured-output.md)")
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    for known in FORMATS:
        if known.tag in text:
            tags = (known.tag, known.close.strip())
            return dataclasses.replace(known, tokens=tuple((t, int(added[t])) for t in tags if t in added))
    raise TriedecError("this model's chat template renders tools in a call format triedec does not read (it knows: "
                       + ", ".join(f"{f.name} {f.tag}" for f in FORMATS) + ")")


def new_call(name: str, arguments: str) -> ToolCall:
    """A call with a fresh id."""
    return ToolCall(f"call_{secrets.token_hex(12)}", name, arguments)


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message as chat templates read it: an assistant's ``tool_calls`` with their
    ``arguments`` as objects (OpenAI sends JSON text; templates write them with ``tojson``) and
    ``content`` ``""`` where it is null. Raises :class:`ToolsError` for arguments that are not a
    JSON object."""
    out = {k: v for k, v in message.items() if v is not None}
    out.setdefault("content", "")
    calls = message.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                except ValueError:
                    raise ToolsError("messages", "a tool call's arguments are not valid JSON") from None
            fixed.append({**call, "function": function})
        out["tool_calls"] = fixed
    return out


def _call_rule(fmt: ToolFormat, function: Function) -> str:
    schema = {**json.loads(function.parameters), "x-guidance": _JSON_LAYOUT}
    head = f'{fmt.open}{{"name": "{function.name}", "arguments": '
    return f"{fmt.lark(head)} %json {json.dumps(schema)} {fmt.lark('}' + fmt.close)}"


def _not_starting_with(tag: str) -> str:
    """A regex (Rust syntax, for a Lark terminal between slashes) of every text that does not begin
    with ``tag``: the empty text, ``tag``'s proper prefixes, and texts that leave ``tag`` at some
    character."""

    def lit(s: str) -> str:
        return "".join(f"\\{c}" if c in "\\.+*?()|[]{}^$#&-~/" else c for c in s)

    alternatives = [lit(tag[:i]) for i in range(len(tag))]
    alternatives += [f"{lit(tag[:i])}[^{lit(tag[i])}](?s:.)*" for i in range(len(tag))]
    return "|".join(f"(?:{a})" for a in alternatives)


class CallStream:
    """A reply's text as it streams, split into what a client sees: text (passed on, except while
    it could still be a call's opening tag) or calls (each given whole once its closing tag
    arrives)."""

    def __init__(self, fmt: ToolFormat, required: bool = False) -> None:
        self.fmt = fmt
        self.required = required
        """the reply must be calls (``tool_choice`` ``required`` or a named function): a cut reply
        that wrote only part of the opening tag is calls (none) too"""
        self.kind: str | None = None
        """``"text"`` or ``"calls"`` once known"""
        self.calls: list[ToolCall] = []
        """the calls given so far"""
        self._held = ""
        self._at = 0  # where the next call starts in _held

    def add(self, delta: str) -> tuple[str, list[ToolCall]]:
        """The text to show now and the calls ``delta`` completed."""
        self._held += delta
        if self.kind is None:
            tag = self.fmt.tag
            if self._held.startswith(tag):
                self.kind = "calls"
            elif not tag.startswith(self._held):
                self.kind = "text"
            else:
                return "", []
        if self.kind == "text":
            out, self._held = self._held, ""
            return out, []
        found = []
        fmt = self.fmt
        while (end := self._held.find(fmt.close, self._at)) >= 0:
            piece = self._held[self._at:end + len(fmt.close)]
            self._at = end + len(fmt.close)
            parsed = fmt.parse(piece.removeprefix(fmt.separator) if self.calls or found else piece)
            if parsed:
                found.append(new_call(*parsed[0]))
        self.calls += found
        return "", found

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: held text, or the call a cut reply was writing. A reply that
        began as a call stays calls when it is cut short (by ``max_tokens`` or a stop string): no
        text, the calls that completed, and the one it was writing, once its name was written,
        with the arguments written so far (not yet valid JSON; ``finish_reason`` ``length`` says
        it was cut)."""
        out, self._held = self._held, ""
        if self.kind is None and self.required:  # cut inside the opening tag the grammar asked for
            self.kind = "calls"
            return "", []
        if self.kind == "calls":
            partial = _partial_call(out[self._at:].removeprefix(self.fmt.separator).removeprefix(self.fmt.open))
            if partial is None:
                return "", []
            self.calls.append(partial)
            return "", [partial]
        self.kind = "text"
        return out, []


_WRITING = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(?:,\s*"arguments"\s*:\s*)?')


def _partial_call(body: str) -> ToolCall | None:
    """The call a cut reply was writing (``body``: its JSON so far), once its name is whole."""
    found = _WRITING.match(body)
    if found is None:
        return None
    try:
        name = json.loads(f'"{found.group(1)}"')
    except ValueError:
        return None
    return new_call(name, body[found.end():].rstrip())
