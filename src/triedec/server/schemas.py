"""The server's request and response shapes: OpenAI's, with triedec's own fields in the extra body
(unknown top-level fields ignored and named in a header, unknown nested fields refused, OpenAI
fields triedec does not support named), and OpenAI's error shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


IGNORED_HEADER = "X-Triedec-Warning"
"""The response header that names the top-level request fields the server ignored (unknown to it),
as vLLM ignores them: ``unknown fields ignored: a, b``."""


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


UNSUPPORTED_NEUTRAL: dict[str, object] = {
    "n": 1, "logprobs": False, "top_logprobs": None, "tools": None, "tool_choice": None, "functions": None,
    "function_call": None, "response_format": None, "logit_bias": None, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "parallel_tool_calls": None, "echo": False, "best_of": None, "suffix": None,
}
"""OpenAI fields the server knows but does not support, with the value that asks for nothing."""


class Generation(_Body):
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
    trace: bool = Field(default=False, description="return each decoding step: its tokens, each token's origin "
                        "(the model, or the draft source it was accepted from) and the verified tree, in the "
                        "triedec extension (docs/playground.md)")
    # known, unsupported
    n: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def ignored(self) -> list[str]:
        """The top-level fields the server does not know (ignored), sorted; names are cut to 64
        characters of ``[A-Za-z0-9_.-]`` (they go into a header), at most 16 of them."""
        known = set(UNSUPPORTED_NEUTRAL)
        names = sorted(k for k in (self.model_extra or {}) if k not in known)
        return ["".join(c for c in n if c.isascii() and (c.isalnum() or c in "_.-"))[:64] or "?" for n in names][:16]

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
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(Generation):
    prompt: str | list[int]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


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

    def choice(self, text: str | None, reason: str | None, streaming: bool, first: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"index": 0}
        if not self.chat:
            out["text"] = text or ""
        elif not streaming:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["delta"] = {"role": "assistant", "content": ""} if first else ({} if text is None else
                                                                              {"content": text})
        return {**out, "finish_reason": reason, "logprobs": None}


CHAT_SHAPE = Shape("chat", "chatcmpl", "chat.completion", "chat.completion.chunk", chat=True,
                   path="/v1/chat/completions")
COMPLETION_SHAPE = Shape("completions", "cmpl", "text_completion", "text_completion", chat=False,
                         path="/v1/completions")


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)
