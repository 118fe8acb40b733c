"""What the Ray Serve front end and the Redis exchange cost per request, for README's estimate of
what N machines would serve (README: Scaling out).

Starts a real redis-server on a loopback port and ``triedec serve --ray --replicas 2 --threads 1
--redis-url ...`` (method auto, learning shared), sends streaming chat requests at a fixed
concurrency with the ``openai`` client, and records: wall time, tokens, stream chunks; the CPU
seconds the Gateway, Ray's HTTP proxy and each engine replica spent (psutil, by Ray's process
titles); and what the exchange of learned state wrote to Redis (entries and bytes per stream).

    python benchmarks/serving-ray-cpu/measure_overhead.py OUT.json [--requests 48] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_processes() -> dict[str, psutil.Process]:
    found = {}
    for proc in psutil.process_iter(["cmdline", "name"]):
        title = " ".join(proc.info["cmdline"] or []) or proc.info["name"] or ""
        for role in ("ServeReplica:triedec:Gateway", "ServeReplica:triedec:Engine", "ProxyActor", "ServeController"):
            if role in title:
                found[f"{role}#{proc.pid}"] = proc
    return found


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, proc in procs.items():
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            out[name] = t.user + t.system
    return out


async def load(base: str, n: int, concurrency: int) -> tuple[int, int]:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    tokens = chunks = 0

    async def one(i: int) -> None:
        nonlocal tokens, chunks
        async with gate:
            stream = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", max_tokens=32, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"Write one sentence about the number {i}."}])
            async for chunk in stream:
                chunks += 1
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens

    await asyncio.gather(*(one(i) for i in range(n)))
    return tokens, chunks


def absorb_cost(answers: int = 8, tokens: int = 96) -> dict[str, float]:
    """In-process: what merging another replica's finished outputs costs the engine thread (auto,
    the default model): ``answers`` answers of ``tokens`` tokens made on one LM, exported, then
    decoded from JSON and absorbed by a fresh one, as the exchange does."""
    import triedec
    from triedec.drafters.learned import Learned

    made = triedec.load()
    for i in range(answers):
        made.generate([{"role": "user", "content": f"Write a short paragraph about the number {i}."}], "auto",
                      max_new_tokens=tokens)
    exported = [e for e in made.export_learned() if e[1] == "auto"]
    texts = [learned.to_json() for _, _, _, learned in exported]
    fresh = made.fresh()
    fresh.decoder("auto")
    start = time.perf_counter()
    for (scope, name, options, _), text in zip(exported, texts, strict=True):
        fresh.absorb_learned(scope, name, options, Learned.from_json(text))
    seconds = time.perf_counter() - start
    outputs = sum(len(learned.outputs) for _, _, _, learned in exported)
    return {"outputs": outputs, "json_bytes": sum(len(x) for x in texts), "absorb_seconds": seconds,
            "ms_per_output": 1000 * seconds / max(1, outputs)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    redis_port, port = free_port(), free_port()
    store = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(redis_port), "--bind",
                              "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
                             stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{redis_port}/0"
    log = (work / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "triedec.cli.main", "serve", "--ray", "--replicas", "2", "--threads",
                               "1", "--redis-url", url, "--method", "auto", "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    result: dict = {}
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, (work / "serve.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.5)
        asyncio.run(load(base, 4, 4))  # warm-up
        time.sleep(2)
        procs = ray_processes()
        before, start = cpu_seconds(procs), time.perf_counter()
        tokens, chunks = asyncio.run(load(base, args.requests, args.concurrency))
        wall = time.perf_counter() - start
        after = cpu_seconds(procs)
        time.sleep(2)  # the last exchange of learned state
        r = redis.Redis.from_url(url)
        streams = {}
        for key in r.scan_iter("triedec:*"):
            entries = r.xrange(key)
            sizes = [sum(len(k) + len(v) for k, v in fields.items()) for _, fields in entries]
            streams[key.decode()] = {"entries": len(entries), "bytes": sum(sizes),
                                     "mean_entry_bytes": sum(sizes) / max(1, len(sizes))}
        used = {name: after[name] - before[name] for name in after if name in before}
        roles: dict[str, float] = {}
        for name, seconds in used.items():
            role = name.split("#")[0]
            roles[role] = roles.get(role, 0.0) + seconds
        result = {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": 32, "wall_s": wall,
                  "completion_tokens": tokens, "stream_chunks": chunks, "cpu_seconds_by_process": used,
                  "cpu_seconds_by_role": roles,
                  "gateway_and_proxy_cpu_ms_per_request": 1000 * (roles.get("ServeReplica:triedec:Gateway", 0)
                                                                  + roles.get("ProxyActor", 0)) / args.requests,
                  "redis_streams": streams, "redis_info_memory_bytes": r.info("memory")["used_memory"],
                  "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "platform": platform.platform()},
                  "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True, cwd=Path(__file__).parent).stdout.strip()}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(90)
        except subprocess.TimeoutExpired:
            server.kill()
        store.terminate()
        store.wait(10)
        log.close()
    result["absorb"] = absorb_cost()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
