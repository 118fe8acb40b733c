"""``triedec bench --serving``: total tokens/s and latency against concurrency, through the real
server, as a user would run it.

Protocol (one process, one loaded model):

* the requests are distinct chat prompts (first turns of the selected questions), the same ones at
  every concurrency, each asking for ``max_tokens`` tokens, greedy or sampled (request k seeded
  ``seed + k``, so every method and concurrency draws the same text);
* every (method, concurrency) phase gets a **fresh server**: a ``triedec serve`` process of its
  own, started as a user would start it (same model flags; the device calibration read from the
  shared cache), so learned state starts fresh too: a prompt answered in an earlier phase would
  otherwise be drafted from its own answer by auto's store, which measures replay, not serving.
  One warm-up request on a prompt outside the sample starts each phase (untimed);
* every phase runs ``repeats`` times, each a fresh server, in blocks
  (:func:`~triedec.bench.stats.paired_order`): one block per (concurrency, repeat) runs every
  method (and setup) back to back, in an order of its own, and the blocks run in one seeded random
  order, so that no method always runs first and the two phases a ratio pairs are minutes apart at
  most; a method's ratio to ``ar`` at a concurrency pairs the two phases of the same repeat
  (:mod:`triedec.bench.serving_report`);
* clients are the ``openai`` client over loopback (:mod:`triedec.bench.load`), ``concurrency``
  requests in flight at a time; a phase's tokens/s is its completion tokens over its wall time;
  latency is request start to last byte (p50/p95);
* ``one at a time`` through the server is compared with in-process ``lm.generate`` on the same
  requests (fresh state, one at a time), and, with ``batch_sizes`` (greedy runs only),
  ``lm.generate_batch`` with stock transformers' own ``generate_batch`` (continuous batching, the
  unmodified model), same requests, same run;
* recorded: the prompts' ids, every method's solo outputs and each phase's texts that differ from
  them, the sampling, the calibration the drafts were sized under (and whether it was measured on
  a busy machine), the machine, versions and commit;
* exactness: every response's text is compared with the same method's in-process solo text, and
  every ``generate_batch`` output's tokens with the solo tokens; a token that differs is reported
  with its position and stock transformers' top-2 logit gap there (a near-tie another arrangement
  of the arithmetic may break either way, or a bug).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

from triedec.api.generation import GenerationRequest
from triedec.api.lm import LM
from triedec.bench.datasets import Question
from triedec.bench.harness import first_mismatch
from triedec.bench.load import LoadRequest, run_load, summarize_load
from triedec.bench.stats import paired_order
from triedec.core.errors import TriedecError, positive_int
from triedec.core.sampling import GREEDY_SAMPLING, MAX_SEED, Sampling
from triedec.drafters import NEEDS_COST
from triedec.engine.methods import method

WARMUP_PROMPT = "Name three colours of the rainbow."
"""The untimed request that starts each phase (not in any benchmark sample)."""


@dataclass(frozen=True)
class ServingConfig:
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_tokens: int = 128
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16)
    """request counts for generate_batch vs transformers' generate_batch (empty: skipped)"""
    seed: int = 0
    """seeds the order of the phases"""
    repeats: int = 1
    """timed runs of every phase, each on a fresh server"""
    sampling: Sampling = GREEDY_SAMPLING
    """the requests' sampling; request k is seeded ``sampling.seed + k`` (``k`` without a seed)"""
    setups: tuple[tuple[str, tuple[str, ...]], ...] = (("", ()),)
    """server setups to load: (name, extra ``triedec serve`` flags), e.g. ``("ray-2", ("--ray",
    "--replicas", "2", "--threads", "1"))``; a phase is a (method, setup, concurrency); the
    default is one plain process, named ``""``"""

    def __post_init__(self) -> None:
        if not self.concurrencies:
            raise TriedecError("--concurrency needs at least one value")
        names = [name for name, _ in self.setups]
        if not names or len(set(names)) != len(names):
            raise TriedecError(f"server setups need distinct names, got {names}")
        for c in (*self.concurrencies, *self.batch_sizes):
            positive_int("a concurrency or batch size", c)
        positive_int("max_tokens", self.max_tokens)
        positive_int("repeats", self.repeats)
        if not isinstance(self.sampling, Sampling):
            raise TriedecError(f"sampling must be a Sampling, got {self.sampling!r}")


def parse_counts(text: str, what: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); clear errors for anything else."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise TriedecError(f"{what} must be comma-separated positive integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise TriedecError(f"{what} must be comma-separated positive integers, got {text!r}")
    return values


def chat_requests(questions: Sequence[Question], max_tokens: int,
                  sampling: Sampling = GREEDY_SAMPLING) -> tuple[list[LoadRequest], list[str]]:
    """One distinct chat request per question (its first turn), with its question's id. Sampling
    parameters other than greedy's defaults go in the extra body; when sampled, request k carries
    seed :func:`request_sampling` gives it."""
    seen, out, ids = set(), [], []
    for q in questions:
        if q.turns[0] not in seen:
            seen.add(q.turns[0])
            chosen = request_sampling(sampling, len(out))
            extra = {k: v for k, v in chosen.as_dict().items()
                     if k != "seed" and v != getattr(GREEDY_SAMPLING, k)}
            if "logit_bias" in extra:  # OpenAI's JSON: token ids as strings
                extra["logit_bias"] = {str(t): b for t, b in chosen.logit_bias}
            if not chosen.greedy:
                extra["seed"] = chosen.seed
            out.append(LoadRequest(max_tokens, messages=[{"role": "user", "content": q.turns[0]}], extra=extra))
            ids.append(q.id)
    return out, ids


def request_sampling(sampling: Sampling, k: int) -> Sampling:
    """Request ``k``'s sampling: ``sampling`` with seed ``sampling.seed + k`` (``k`` without one),
    the same in-process and through the server."""
    if sampling.greedy:
        return sampling
    return dataclasses.replace(sampling, seed=((sampling.seed or 0) + k) % MAX_SEED)


@dataclass(frozen=True)
class Entry:
    """A method as the benchmark names it (``name[:key=value...]``): its label, name, and options
    as text (``flags``, for ``triedec serve``) and parsed (``options``, for the API)."""

    label: str
    name: str
    texts: dict[str, str]
    options: dict[str, object]

    @classmethod
    def parse(cls, entry: str) -> Entry:
        from triedec.bench.run import parse_method_entry

        name, texts = parse_method_entry(entry)
        return cls(entry.strip(), name, texts, method(name).spec.parse_options(texts))

    @property
    def flags(self) -> list[str]:
        out = ["--method", self.name]
        for key, text in self.texts.items():
            out += [f"--{self.name}-{key.replace('_', '-')}", text]
        return out


@contextlib.contextmanager
def server_process(serve_args: Sequence[str], entry: Entry, model_name: str, max_running: int,
                   timeout: float = 300.0) -> Iterator[str]:
    """A ``triedec serve`` process on a free loopback port for the block (``serve_args``: the
    model flags); yields its base URL; SIGTERM and a wait at the end."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "triedec.cli.main", "serve", *serve_args, *entry.flags, "--port", str(port),
               "--model-name", model_name, "--max-running", str(max_running)]
    # the server's log goes to a file, not a pipe: a chatty server (Ray's) never blocks on it
    with tempfile.TemporaryFile(mode="w+") as log, \
            running_server(command, f"http://127.0.0.1:{port}", log, timeout) as base:
        yield base


@contextlib.contextmanager
def running_server(command: Sequence[str], base: str, log: IO[str], timeout: float = 300.0,
                   name: str = "triedec serve") -> Iterator[str]:
    """``command``, a server that answers ``GET {base}/health`` (``triedec serve``, llama.cpp's
    ``llama-server``), running for the block with its output in ``log`` (a file); yields ``base``
    once it is healthy; SIGTERM and a wait at the end (a kill after 60 s)."""
    proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, base, log, timeout, name)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(proc: subprocess.Popen[str], base: str, log: Any, timeout: float, name: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise TriedecError(f"{name} exited with {proc.returncode}: {log.read()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TriedecError(f"{name} did not start in time")
        time.sleep(0.2)


def _solo(lm: LM, entry: Entry, requests: Sequence[LoadRequest],
          sampling: Sampling = GREEDY_SAMPLING) -> tuple[list[list[int]], list[str], float]:
    """In-process ``lm.generate``, one at a time, fresh state: token ids, texts, tokens/s in total."""
    fresh = lm.fresh()
    fresh.generate([{"role": "user", "content": WARMUP_PROMPT}], entry.name, max_new_tokens=8, **entry.options)
    ids, texts, seconds = [], [], 0.0
    for k, r in enumerate(requests):
        start = time.perf_counter()
        out = fresh.generate(GenerationRequest(list(r.messages or ()), entry.name, entry.options, r.max_tokens,
                                               sampling=request_sampling(sampling, k)))
        seconds += time.perf_counter() - start
        ids.append(out.token_ids)
        texts.append(out.text)
    return ids, texts, sum(len(t) for t in ids) / seconds


def _mismatches(lm: LM, prompts: Sequence[list[int]], reference: Sequence[list[int]],
                got: Sequence[list[int]]) -> list[dict[str, Any]]:
    out = []
    for i, (prompt, ref, tokens) in enumerate(zip(prompts, reference, got, strict=True)):
        if ref != tokens:
            out.append({"request": i, **first_mismatch(lm, prompt, ref, tokens)})
    return out


def _hf_generate_batch(lm: LM, prompts: Sequence[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Stock transformers' ``generate_batch`` (continuous batching) on the unmodified model,
    greedy, after one untimed warm-up call: tokens per prompt, in order, and the seconds the timed
    call took. Its KV cache is sized to the workload (every prompt and its answer at once), not
    from the machine's free memory: on a CPU with tens of GiB that default allocates, and clears
    every step, an attention mask of gigabytes. Its own INFO logging is quieted for the call."""
    import logging

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = lm.reference_model()
    eos = sorted(lm.eos_token_ids)
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos or None,
                              pad_token_id=lm.tokenizer.pad_token_id or (eos[0] if eos else 0))
    page = 256
    blocks = sum(-(-(len(p) + max_tokens) // page) for p in prompts) + 1
    batching = ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                        max_batch_tokens=max(256, max(len(p) for p in prompts)))
    logger = logging.getLogger("ContinuousBatchingLogger")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        model.generate_batch(inputs=[list(prompts[0])], generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id),
            continuous_batching_config=batching)
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=config,
                                       continuous_batching_config=batching, progress_bar=False)
        seconds = time.perf_counter() - start
    finally:
        logger.setLevel(level)
    by_id = sorted(outputs.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
    return [list(o.generated_tokens) for o in by_id], seconds


def run_serving(lm: LM, methods: Sequence[str], questions: Sequence[Question], config: ServingConfig,
                serve_args: Sequence[str], model_name: str = "default",
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the protocol (module doc); the results as a JSON-able dict. ``methods`` are entries
    (``name[:key=value...]``); ``serve_args`` are the model flags of ``triedec serve`` that load the
    same model as ``lm``."""
    entries = {e.label: e for e in map(Entry.parse, methods)}
    methods = list(entries)
    requests, prompt_ids = chat_requests(questions, config.max_tokens, config.sampling)
    if len(requests) < max(config.concurrencies):
        raise TriedecError(f"{len(requests)} distinct requests cannot load a concurrency of "
                           f"{max(config.concurrencies)}; select more questions")
    say = progress or (lambda text: None)
    found = {e.name: method(e.name) for e in entries.values()}
    sized = any(NEEDS_COST in found[e.name].needs(found[e.name].make_options(e.options)) for e in entries.values())
    calibration = lm.calibration() if sized else None  # cached: every phase sizes under it
    surface = calibration.cost.surface_ms() if calibration is not None else None
    prompts = [lm.encode(list(r.messages or ()), chat=True) for r in requests]
    solo = {}
    for m in methods:
        say(f"in-process solo: {m}")
        solo[m] = _solo(lm, entries[m], requests, config.sampling)
    setups = dict(config.setups)
    labels = {(m, s): f"{m} {s}".strip() for m in methods for s in setups}
    phases = [(m, s, c, r) for (m, s), c, r in paired_order([(m, s) for m in methods for s in setups],
                                                            config.concurrencies, config.repeats, config.seed)]
    rows = []
    for done, (m, s, c, r) in enumerate(phases):
        say(f"phase {done + 1}/{len(phases)}: {labels[m, s]} at concurrency {c}, repeat {r + 1}")
        with server_process([*serve_args, *setups[s]], entries[m], model_name, max(config.concurrencies)) as base:
            url = f"{base}/v1"
            run_load(url, model_name, [LoadRequest(8, messages=[{"role": "user", "content": WARMUP_PROMPT}])], 1)
            responses, seconds = run_load(url, model_name, requests, concurrency=c)
        summary = summarize_load(responses, seconds)
        differ = [{"request": k, "text": got.text} for k, (got, want) in enumerate(zip(responses, solo[m][1],
                                                                                         strict=True))
                  if got.text != want]
        rows.append({"method": labels[m, s], "base_method": m, "setup": s, "server_flags": list(setups[s]),
                     "concurrency": c, "repeat": r, **summary, "identical_texts": len(responses) - len(differ),
                     "differing_texts": differ, "latencies_s": [x.seconds for x in responses],
                     "completion_tokens_each": [x.completion_tokens for x in responses]})
    order = list(labels.values())
    rows.sort(key=lambda row: (order.index(row["method"]), row["concurrency"], row["repeat"]))
    batches = []
    for n in config.batch_sizes if config.sampling.plain else ():  # a greedy comparison: skipped when sampled
        if n > len(requests):
            continue
        say(f"generate_batch of {n}: triedec and transformers")
        sides = ["triedec", "transformers"]
        random.Random(config.seed + n).shuffle(sides)
        timed = {}
        for who in sides:
            if who == "triedec":
                first = entries[methods[0]]
                fresh = lm.fresh()
                fresh.generate([{"role": "user", "content": WARMUP_PROMPT}], first.name, max_new_tokens=8,
                               **first.options)
                start = time.perf_counter()
                outs = fresh.generate_batch(prompts[:n], first.name, max_new_tokens=config.max_tokens, progress=False,
                                            **first.options)
                timed[who] = ([o.token_ids for o in outs], time.perf_counter() - start)
            else:
                timed[who] = _hf_generate_batch(lm, prompts[:n], config.max_tokens)
        row: dict[str, Any] = {"requests": n, "method": methods[0]}
        for who, (tokens, seconds) in timed.items():
            row[f"{who}_tokens_per_s"] = sum(len(t) for t in tokens) / seconds
            row[f"{who}_seconds"] = seconds
        row["speedup"] = row["triedec_tokens_per_s"] / row["transformers_tokens_per_s"]
        row["mismatches_vs_solo"] = _mismatches(lm, prompts[:n], solo[methods[0]][0][:n], timed["triedec"][0])
        row["transformers_mismatches_vs_solo"] = len(_mismatches(lm, prompts[:n], solo[methods[0]][0][:n],
                                                                 timed["transformers"][0]))
        batches.append(row)
    return {"requests": len(requests), "max_tokens": config.max_tokens, "methods": order,
            "prompt_ids": prompt_ids, "sampling": config.sampling.as_dict(), "repeats": config.repeats,
            "order_seed": config.seed, "setups": {s: list(flags) for s, flags in setups.items()},
            "concurrencies": list(config.concurrencies),
            "phase_order": [[labels[m, s], c, r] for m, s, c, r in phases],
            "in_process_tokens_per_s": {m: solo[m][2] for m in methods},
            "solo_outputs": {m: {"texts": solo[m][1], "token_ids": solo[m][0]} for m in methods}, "phases": rows,
            "generate_batch": batches, "kernels": lm.adapter.kernels, "precision": lm.adapter.precision.name,
            "exactness": lm.adapter.exactness,
            "cost_surface": surface,
            "calibration": None if calibration is None else {
                "busy": calibration.busy, "others_cpu_share": calibration.details.get("others_cpu_share"),
                "model_id": calibration.model_id, "device": calibration.device, "dtype": calibration.dtype}}
