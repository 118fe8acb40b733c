"""A bounded load test of a running ``triedec serve`` over loopback, with the ``openai`` client.

:func:`run_load` sends a fixed list of requests, ``concurrency`` at a time, streaming or not as
each says, and records every response's text, finish reason, tokens and latency (request start to
the last byte). :func:`summarize_load` turns that into requests/s, p50/p95 latency and tokens/s in
total. The request loop is bounded in count and time, and it talks only to the URL it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from triedec.bench.stats import percentile


@contextlib.contextmanager
def serving(app: Any, timeout: float = 60.0) -> Iterator[str]:
    """Run ``app`` on a real uvicorn server on a free loopback port, in a thread, for the duration
    of the block; yields its base URL (``http://127.0.0.1:PORT``). A triedec app listens as
    ``triedec serve`` does (:func:`~triedec.server.app.listening_socket`: its send buffer)."""
    import uvicorn

    config = getattr(getattr(app, "state", None), "config", None)
    if config is not None and hasattr(config, "send_buffer_bytes"):
        from triedec.server.app import listening_socket

        sock = listening_socket("127.0.0.1", 0, config.send_buffer_bytes)
    else:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(2048)
    port = sock.getsockname()[1]
    from triedec.server.config import KEEP_ALIVE_SECONDS

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_SECONDS))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


@dataclass(frozen=True)
class LoadRequest:
    """One request: ``messages`` (chat) or ``prompt`` (completions), ``max_tokens``, ``stream`` and
    the extra body (``method``, ``method_options``, sampling)."""

    max_tokens: int
    messages: Sequence[dict[str, str]] | None = None
    prompt: str | None = None
    stream: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadResponse:
    text: str
    finish_reason: str | None
    completion_tokens: int
    seconds: float
    chunks: int


async def _one(client: Any, model: str, req: LoadRequest) -> LoadResponse:
    start = time.perf_counter()
    extra = dict(req.extra)
    if req.messages is not None:
        if req.stream:
            parts, reason, chunks, tokens = [], None, 0, 0
            stream = await client.chat.completions.create(
                model=model, messages=list(req.messages), max_tokens=req.max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body=extra)
            async for chunk in stream:
                chunks += 1
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    parts.append(choice.delta.content or "")
                    reason = choice.finish_reason or reason
            return LoadResponse("".join(parts), reason, tokens, time.perf_counter() - start, chunks)
        out = await client.chat.completions.create(model=model, messages=list(req.messages),
                                                   max_tokens=req.max_tokens, extra_body=extra)
        return LoadResponse(out.choices[0].message.content or "", out.choices[0].finish_reason,
                            out.usage.completion_tokens, time.perf_counter() - start, 1)
    if req.stream:
        parts, reason, chunks, tokens = [], None, 0, 0
        stream = await client.completions.create(model=model, prompt=req.prompt, max_tokens=req.max_tokens,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra)
        async for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                parts.append(choice.text or "")
                reason = choice.finish_reason or reason
        return LoadResponse("".join(parts), reason, tokens, time.perf_counter() - start, chunks)
    out = await client.completions.create(model=model, prompt=req.prompt, max_tokens=req.max_tokens,
                                          extra_body=extra)
    return LoadResponse(out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens,
                        time.perf_counter() - start, 1)


async def _load(base_url: str, model: str, requests: Sequence[LoadRequest], concurrency: int,
                timeout: float) -> tuple[list[LoadResponse], float]:
    from openai import AsyncOpenAI

    gate = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(base_url=base_url, api_key="unused", timeout=timeout, max_retries=0) as client:

        async def limited(req: LoadRequest) -> LoadResponse:
            async with gate:
                return await _one(client, model, req)

        start = time.perf_counter()
        done = await asyncio.wait_for(asyncio.gather(*(limited(r) for r in requests)), timeout)
        return list(done), time.perf_counter() - start


def run_load(base_url: str, model: str, requests: Sequence[LoadRequest], concurrency: int,
             timeout: float = 600.0) -> tuple[list[LoadResponse], float]:
    """Send ``requests``, ``concurrency`` at a time, to the server at ``base_url`` (``.../v1``);
    every response in request order, and the wall time of the whole run. Gives up after
    ``timeout`` seconds."""
    return asyncio.run(_load(base_url, model, requests, concurrency, timeout))


def summarize_load(responses: Sequence[LoadResponse], seconds: float) -> dict[str, Any]:
    """requests/s, p50/p95 latency (s, linear between ranks; None without responses), tokens/s
    in total."""
    latencies = [r.seconds for r in responses]
    tokens = sum(r.completion_tokens for r in responses)
    return {"requests": len(responses), "seconds": seconds, "requests_per_s": len(responses) / seconds,
            "p50_latency_s": percentile(latencies, 50), "p95_latency_s": percentile(latencies, 95),
            "completion_tokens": tokens, "tokens_per_s": tokens / seconds}
