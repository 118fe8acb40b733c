"""The server's request and response shapes: OpenAI's, with triedec's own fields in the extra body
(unknown top-level fields ignored and named in a header, unknown nested fields refused, OpenAI
fields triedec does not support named), and OpenAI's error shape."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from triedec.api.text import token_label, token_name, token_text
from triedec.api.tools import Tools, ToolsError, template_message
from triedec.core.errors import TriedecError
from triedec.core.grammar import Grammar
from triedec.core.logprobs import MAX_TOP_LOGPROBS, Logprobs, TokenLogprob


class Body(BaseModel):
    """A strict request body: unknown fields and wrong types are 400s."""

    model_config = ConfigDict(extra="forbid", strict=True)


MAX_CHOICES = 16
"""The most choices (``n``) one request may ask for; each is a request of its own in the batch and
in its tenant's share."""

MAX_LOGPROB_ENTRIES = 50_000
"""The most logprob entries one request's response may hold: tokens x (1 + alternatives), over its
prompts and choices, for echoed prompts' logprobs, vLLM's ``prompt_logprobs`` and the generated
tokens' ``logprobs`` (an entry is ~100 bytes of JSON: ~5 MB at the cap). A request asking for more
is refused (400 naming the field) before it runs."""

MAX_HYPOTHESES = 256
"""The most beam hypotheses one request may ask for, prompts x ``num_beams`` (each is a row of
every step's forward; a batch counts a beam search's rows in its client's share of a step)."""

IGNORED_HEADER = "X-Triedec-Warning"
"""The response header that names the top-level request fields the server ignored (unknown to it),
as vLLM ignores them: ``unknown fields ignored: a, b``."""


class TextPart(Body):
    type: Literal["text"]
    text: str


class CalledFunction(Body):
    name: str
    arguments: str


class MessageToolCall(Body):
    """A call an earlier assistant message made (sent back with the ``tool`` message that answers
    it)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (:func:`triedec.api.tools.template_message`)."""
        if self.content is None and not self.tool_calls:
            raise FieldError("messages", f"a {self.role} message needs content")
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return template_message(message)


class StreamOptions(Body):
    include_usage: bool = False


UNSUPPORTED_NEUTRAL: dict[str, object] = {"functions": None, "function_call": None, "suffix": None}
"""OpenAI fields the server knows but does not support, with the value that asks for nothing."""


class Generation(Body):
    """Fields both endpoints share: OpenAI's, then triedec's extra-body ones. A top-level field the
    server does not know is ignored and named in the :data:`IGNORED_HEADER` response header (nested
    objects stay strict: a typo inside ``messages`` or ``method_options`` is a 400)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    user: str | None = None
    # triedec's own (extra body)
    method: str | None = Field(default=None, description="triedec decoding method (default: the server's)")
    method_options: dict[str, Any] | None = Field(default=None, description="the method's options")
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, description="vLLM's: no end-of-sequence, stop token or stop string "
                                   "before this many tokens")
    ignore_eos: bool = Field(default=False, description="vLLM's: the model's end-of-sequence tokens do not stop "
                             "generation")
    stop_token_ids: list[int] | None = Field(default=None, description="vLLM's: token ids that end generation like "
                                             "end-of-sequence")
    logprobs_mode: str | None = Field(default=None, description="which distribution logprobs describe: 'raw' (the "
                                      "model's log-softmax, the default) or 'processed' (the one the token was "
                                      "chosen from, after the penalty, temperature and filters)")
    trace: bool = Field(default=False, description="return each decoding step: its tokens, each token's origin "
                        "(the model, or the draft source it was accepted from) and the verified tree, in the "
                        "triedec extension (docs/playground.md)")
    cache_salt: str | None = Field(default=None, description="vLLM's: the prefix trie's scope within the "
                                   "tenant's: a request finds cached KV only of requests with the same salt")
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    prompt_logprobs: int | None = Field(default=None, description="vLLM's: each prompt token's logprob and this many "
                                        "alternatives (0-20), in vLLM's shape")
    response_format: dict[str, Any] | None = Field(default=None, description="OpenAI's: {\"type\": \"text\"}, "
                                                   "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                                                   "\"json_schema\": {\"name\", \"schema\", \"strict\"}}")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM's: output valid against this "
                                                     "JSON schema")
    guided_regex: str | None = Field(default=None, description="vLLM's: output that matches this regex (Rust syntax)")
    guided_choice: list[str] | None = Field(default=None, description="vLLM's: output that is one of these strings")
    guided_grammar: str | None = Field(default=None, description="vLLM's: output in this grammar's language (Lark, "
                                       "start rule `start`; or GBNF, start rule `root`)")

    def grammar(self) -> tuple[str, Grammar] | None:
        """The grammar the output must match (``response_format`` or one ``guided_*`` field),
        checked for shape and size, with the field that asked for it; None when none is asked."""
        asked: list[tuple[str, Grammar]] = []
        try:
            form = self.response_format
            if form is not None:
                kind = form.get("type")
                if kind == "json_object" and set(form) == {"type"}:
                    asked.append(("response_format", Grammar.json_object()))
                elif kind == "json_schema" and set(form) == {"type", "json_schema"}:
                    spec = form["json_schema"]
                    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict) or not set(spec) <= {
                            "name", "schema", "strict", "description"}:
                        raise TriedecError('response_format json_schema must be {"name", "schema": {...}, "strict", '
                                           '"description"} with a schema object')
                    if "strict" in spec and not isinstance(spec["strict"], bool):
                        raise TriedecError("response_format json_schema.strict must be true or false")
                    asked.append(("response_format", Grammar.json_schema(spec["schema"])))
                elif not (kind == "text" and set(form) == {"type"}):
                    raise TriedecError('response_format must be {"type": "text"}, {"type": "json_object"} or '
                                       '{"type": "json_schema", "json_schema": {...}}')
        except TriedecError as exc:
            raise FieldError("response_format", str(exc)) from None
        guided = {"guided_json": Grammar.json_schema, "guided_regex": Grammar.regex, "guided_choice": Grammar.choice,
                  "guided_grammar": lambda text: Grammar.gbnf(text) if "::=" in text else Grammar.lark(text)}
        for name, make in guided.items():
            value = getattr(self, name)
            if value is not None:
                try:
                    asked.append((name, make(value)))
                except TriedecError as exc:
                    raise FieldError(name, str(exc)) from None
        if len(asked) > 1:
            raise FieldError(asked[1][0], f"{asked[0][0]} and {asked[1][0]} both constrain the output; send one")
        return asked[0] if asked else None

    def ignored(self) -> list[str]:
        """The top-level fields the server does not know (ignored), sorted; names are cut to 64
        characters of ``[A-Za-z0-9_.-]`` (they go into a header), at most 16 of them."""
        known = set(UNSUPPORTED_NEUTRAL)
        names = sorted(k for k in (self.model_extra or {}) if k not in known)
        return ["".join(c for c in n if c.isascii() and (c.isalnum() or c in "_.-"))[:64] or "?" for n in names][:16]

    def choices(self) -> int:
        """How many choices the request asks for per prompt (``n``: 1 to :data:`MAX_CHOICES`)."""
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_CHOICES:
            raise FieldError("n", f"n must lie in [1, {MAX_CHOICES}] (this server's cap), got {n}")
        return n

    def candidates(self) -> int:
        """How many runs make a prompt's choices: ``best_of`` (completions; n to
        :data:`MAX_CHOICES`, the n with the highest sum of logprobs returned), else ``n``."""
        n, best = self.choices(), getattr(self, "best_of", None)
        if best is None:
            return n
        if not n <= best <= MAX_CHOICES:
            raise FieldError("best_of", f"best_of must lie in [n, {MAX_CHOICES}] (n = {n}; this server's cap), got "
                                        f"{best}")
        if best > n and self.stream:
            raise FieldError("best_of", "best_of > n does not stream (the best are known only at the end), as with "
                                        "OpenAI")
        return best

    def asked_logprobs(self, chat: bool) -> Logprobs | None:
        """What the request asks to see of each generated token's probability, in its endpoint's
        spelling: chat ``logprobs: true`` with ``top_logprobs`` 0-20; completions ``logprobs: k``
        (0-20)."""
        mode = self.logprobs_mode_asked()
        if chat:
            if self.logprobs is not None and not isinstance(self.logprobs, bool):
                raise FieldError("logprobs", f"logprobs must be true or false in a chat request, got {self.logprobs!r}"
                                             " (the number of alternatives is top_logprobs)")
            if not self.logprobs:
                if self.top_logprobs is not None:
                    raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
                return None
            top = 0 if self.top_logprobs is None else self.top_logprobs
            name = "top_logprobs"
        else:
            if self.top_logprobs is not None:
                raise FieldError("top_logprobs", "top_logprobs is a chat field: a completion request asks for k "
                                                 "alternatives with logprobs: k")
            if self.logprobs is None or self.logprobs is False:
                return None
            if self.logprobs is True:
                raise FieldError("logprobs", "logprobs must be an integer in a completion request (the number of "
                                             "alternatives, 0-20), got true")
            top, name = self.logprobs, "logprobs"
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise FieldError(name, f"{name} must lie in [0, {MAX_TOP_LOGPROBS}] (this server's cap), got {top}")
        return Logprobs(top, mode)

    def logprobs_mode_asked(self) -> str:
        """``logprobs_mode``, checked (``raw`` when not given)."""
        mode = Logprobs.mode if self.logprobs_mode is None else self.logprobs_mode
        try:
            Logprobs(0, mode)
        except TriedecError as exc:
            raise FieldError("logprobs_mode", str(exc)) from None
        return mode

    def asked_prompt_logprobs(self) -> int | None:
        """vLLM's ``prompt_logprobs``: each prompt token's logprob with this many alternatives
        (0-20), or None."""
        k = self.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise FieldError("prompt_logprobs", f"prompt_logprobs must lie in [0, {MAX_TOP_LOGPROBS}] (this server's "
                                                f"cap), got {k}")
        return k

    def prompts(self) -> list[Any]:
        """The request's prompts: one (text, or token ids), or several (completions' list of texts
        or of token-id lists), each answered by its own choices; chat: its messages."""
        raise NotImplementedError

    def unsupported(self) -> list[str]:
        given = self.model_dump(exclude_unset=True)
        return [k for k, neutral in UNSUPPORTED_NEUTRAL.items()
                if k in given and given[k] not in (None, neutral) and given[k] not in ({}, [])]


class ChatRequest(Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def prompts(self) -> list[Any]:
        return [[m.as_template() for m in self.messages]]

    def asked_tools(self) -> Tools | None:
        """The request's tools, checked (None: none)."""
        try:
            return Tools.of(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolsError as exc:
            raise FieldError(exc.param, str(exc)) from None


class CompletionRequest(Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[Any]:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


@dataclass(frozen=True)
class Shape:
    """What one endpoint's responses look like: its metrics label, id prefix, object names, and
    whether a choice carries a chat message (a ``delta`` when streaming) or plain ``text``."""

    endpoint: str
    id_prefix: str
    object: str
    chunk_object: str
    chat: bool
    path: str
    """the route that answers in this shape"""

    def choice(self, text: str | None, reason: str | None, streaming: bool, first: bool = False,
               logprobs: dict[str, Any] | None = None, index: int = 0,
               prompt_logprobs: list[Any] | None = None, tool_calls: list[dict[str, Any]] | None = None
               ) -> dict[str, Any]:
        """One choice (a chunk's, when ``streaming``); vLLM's ``prompt_logprobs`` go in a
        completion's choice (a chat response carries them at its top level); ``tool_calls``: a chat
        reply's calls (its content is then null), or a chunk's."""
        out: dict[str, Any] = {"index": index}
        if not self.chat:
            out["text"] = text or ""
            if prompt_logprobs is not None:
                out["prompt_logprobs"] = prompt_logprobs
        elif not streaming:
            out["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                out["message"] = {"role": "assistant", "content": None, "tool_calls": tool_calls}
        else:
            out["delta"] = {"role": "assistant", "content": ""} if first else ({} if text is None else
                                                                              {"content": text})
            if tool_calls:
                out["delta"] = {"tool_calls": tool_calls}
        return {**out, "finish_reason": reason, "logprobs": logprobs}

    def logprobs(self, items: Sequence[TokenLogprob], tokenizer: Any, offsets: Sequence[int],
                 lead: int | None = None) -> dict[str, Any]:
        """``items`` (one per token) in this endpoint's ``logprobs`` shape: chat's ``{"content":
        [{token, logprob, bytes, top_logprobs}]}``, or completions' ``{tokens, token_logprobs,
        top_logprobs, text_offset}`` (its ``top_logprobs`` dicts hold the chosen token too, as
        OpenAI's and vLLM's do; ``offsets``: each token's start in the text; ``lead``: an echoed
        prompt's first token, which has no logprob: ``null`` in both lists)."""
        if self.chat:
            def entry(token: int, logprob: float) -> dict[str, Any]:
                label, raw = token_name(tokenizer, token)
                return {"token": label, "logprob": _json_logprob(logprob), "bytes": raw}

            return {"content": [{**entry(i.token, i.logprob), "top_logprobs": [entry(t, v) for t, v in i.top]}
                                for i in items], "refusal": None}
        tops: list[dict[str, float] | None] = []
        for i in items:
            top = {token_label(tokenizer, t): _json_logprob(v) for t, v in i.top}
            if i.top:
                top.setdefault(token_label(tokenizer, i.token), _json_logprob(i.logprob))
            tops.append(top)
        tokens: list[str] = [token_label(tokenizer, i.token) for i in items]
        values: list[float | None] = [_json_logprob(i.logprob) for i in items]
        if lead is not None:
            tokens, values, tops = [token_label(tokenizer, lead), *tokens], [None, *values], [None, *tops]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": list(offsets)}

    @staticmethod
    def joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
        """Two :meth:`logprobs` values of consecutive tokens as one (an echoed prompt's, then the
        completion's)."""
        return {k: v + then[k] if isinstance(v, list) else v for k, v in first.items()}


def vllm_prompt_logprobs(items: Sequence[TokenLogprob], tokenizer: Any, top: int) -> list[Any]:
    """vLLM's ``prompt_logprobs``: ``None`` for the prompt's first token, then for each token a
    dict from token id (a string, as JSON keys are) to ``{logprob, rank, decoded_token}``: the
    prompt's own token (its rank among the vocabulary) and its ``top`` most likely alternatives
    (ranks 1..top)."""
    out: list[Any] = [None]
    for item in items:
        entry = {str(item.token): {"logprob": _json_logprob(item.logprob), "rank": item.rank,
                                   "decoded_token": token_text(tokenizer, item.token)}}
        for rank, (token, value) in enumerate(item.top[:top], 1):
            entry.setdefault(str(token), {"logprob": _json_logprob(value), "rank": rank,
                                          "decoded_token": token_text(tokenizer, token)})
        out.append(entry)
    return out


LEAST_LOGPROB = -9999.0
"""What a response shows for a logprob of ``-inf`` (a token the processed distribution excludes,
met only when scoring a prompt), as vLLM does: JSON has no infinity."""


def _json_logprob(value: float) -> float:
    return max(value, LEAST_LOGPROB)


CHAT_SHAPE = Shape("chat", "chatcmpl", "chat.completion", "chat.completion.chunk", chat=True,
                   path="/v1/chat/completions")
COMPLETION_SHAPE = Shape("completions", "cmpl", "text_completion", "text_completion", chat=False,
                         path="/v1/completions")


class FieldError(TriedecError):
    """Bad input in one request field, named as the client sent it (``param`` of the 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)
