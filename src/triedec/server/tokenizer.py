"""The tokenizer over HTTP, as vLLM's server offers it: ``POST /tokenize``, ``POST /detokenize`` and
``GET /tokenizer_info``. Clients that count tokens or build token-id prompts use them, among them
lm-evaluation-harness's ``local-completions`` (its ``remote`` tokenizer backend), which then needs
no copy of the tokenizer on its own side.

``/tokenize`` tokenizes text as transformers does (a special token's text becomes the control
token, as vLLM's endpoint does: it generates nothing); a completion's text prompt is tokenized with
special tokens split unless the server runs with ``--special-tokens-in-text``
(:mod:`triedec.api.prompts`). ``messages`` go through the chat template exactly as a chat request's
do. Bounds: the body limit, and a text surely longer than the model's context is refused from its
size before it is tokenized; token ids must lie in the vocabulary."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from triedec.api.lm import LM
from triedec.api.prompts import PromptTooLong
from triedec.core.errors import TriedecError
from triedec.server.schemas import Body, ChatMessage, error


class TokenizeRequest(Body):
    """vLLM's ``/tokenize`` body: ``prompt`` (text) or ``messages`` (the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    """text: the tokenizer's own BOS/EOS around it (messages: the template's tokens only)"""
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


TOKENIZER_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")
"""the special tokens ``/tokenizer_info`` names (null when the tokenizer has none)"""


def add_routes(app: FastAPI, lm: LM, model_name: str, split_special: bool) -> None:
    """Add the three routes for ``lm``'s tokenizer (``model_name``: the only ``model`` a body may
    name; ``split_special``: how chat messages' text is tokenized, as for generation)."""
    tokenizer = lm.tokenizer

    def model_error(name: str | None) -> Any:
        if name is not None and name != model_name:
            return error(404, f"model {name!r} not found; this server serves {model_name!r}", "not_found_error",
                         "model")
        return None

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        wrong = model_error(req.model)
        if wrong is not None:
            return wrong
        if (req.prompt is None) == (req.messages is None):
            return error(400, "give exactly one of prompt and messages", param="prompt")
        source: Any = req.prompt if req.prompt is not None else [{"role": m.role, "content": m.text()}
                                                                 for m in req.messages or ()]
        context = lm.max_context
        if context is not None and lm.prompts.at_least_tokens(source) > context:
            return error(400, f"the text is at least {lm.prompts.at_least_tokens(source)} tokens long, past the "
                              f"model's context of {context} tokens", param="prompt" if req.prompt is not None
                         else "messages")

        def run() -> list[int]:
            if req.prompt is not None:
                return lm.prompts.tokenize(req.prompt, req.add_special_tokens, most=context)
            if not source:
                raise TriedecError("messages must not be empty")
            if not req.add_generation_prompt:
                raise TriedecError("add_generation_prompt: false is not supported (the chat template's prompt "
                                   "is what a chat request sends)")
            return lm.encode(source, chat=True, split_special=split_special, most=context)

        try:
            ids = await run_in_threadpool(run)
        except PromptTooLong as exc:  # past the context: found in bounded pieces, never returned whole
            return error(400, f"{exc}: past the model's context of {context} tokens",
                         param="prompt" if req.prompt is not None else "messages")
        except TriedecError as exc:
            return error(400, str(exc), param="messages")
        return {"count": len(ids), "max_model_len": context, "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        wrong = model_error(req.model)
        if wrong is not None:
            return wrong
        vocab = lm.adapter.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            return error(400, f"token ids must lie in [0, {vocab})", param="tokens")
        text = await run_in_threadpool(tokenizer.decode, req.tokens)
        return {"prompt": text}

    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": lm.max_context,
                            "vocab_size": lm.adapter.vocab_size,
                            "chat_template": getattr(tokenizer, "chat_template", None)}
    for field in TOKENIZER_FIELDS:
        value = getattr(tokenizer, field, None)
        info[field] = value if isinstance(value, str) else None

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return info
