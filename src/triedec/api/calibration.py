"""Device calibration: what a forward costs here, and the profiles methods declare. A top-layer
module: it measures through an :class:`~triedec.api.lm.LM`; the values it produces
(:class:`~triedec.core.costmodel.CostModel`, each method's profile) are pure and reach the engine and
the drafters through ``ModelInfo``. Results are cached as JSON per model + device (on a CPU: the
host's CPU model, core count and feature flags, :func:`triedec.core.machine.host_key`) + CPU threads + dtype + kernels
under the triedec cache directory; :func:`read_calibration` reads one without measuring.

* **cost model** (:func:`measure_cost_model`, under a minute) -- median seconds of one forward of
  T tree tokens of one request (the sizes in :data:`TREE_SIZES`), of forwards that carry B
  requests with t tokens each (:data:`BATCH_GRID`), each request on a ``context_tokens`` cache,
  and the extra cost of a longer context. Sizes are interleaved across repeats so that machine
  noise spreads evenly;
* **profiles** -- a method that needs one declares it (``register(..., profile=ProfileSpec)``,
  ``needs`` naming the method): calibration hands its ``measure`` a :class:`Bench` (calibration
  prompts, never benchmark prompts; a way to decode them with a drafter) and stores what it returns
  with ``dump``. Token Recycling's tree profile is one (:mod:`triedec.drafters.recycling`).

Methods say what they need (``MethodSpec.needs``); the :class:`~triedec.api.lm.LM` loads or measures
exactly that before it builds them. How much is measured is an effort
(:data:`~triedec.core.params.CALIBRATION_EFFORTS`: ``full`` by default, ``quick`` when
``TRIEDEC_CALIBRATION=quick``), recorded in the file. Processes that share a cache directory (a
server's replicas, a test suite's workers) measure a calibration once: the first takes a lock
beside the file, the others wait for it and read what it wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError, positive_int
from triedec.core.machine import CpuWatch, host_key
from triedec.core.params import (
    CALIBRATION_EFFORT_ENV,
    CALIBRATION_EFFORTS,
    DEFAULT_CALIBRATION_EFFORT,
    CalibrationEffort,
)
from triedec.core.tree import TokenTree
from triedec.drafters import Drafter, ModelInfo
from triedec.drafters.registry import NEEDS_COST, profile_specs
from triedec.engine.batch import run_alone
from triedec.engine.request import Request, StopRule
from triedec.model.adapter import ForwardItem, ModelAdapter, cache_keyword
from triedec.model.precision import layer_mix

TREE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 81)
"""Tree sizes (tokens, the root included) of one request whose forward cost is measured (81: the
Token Recycling paper's whole tree)."""
BATCH_GRID = ((2, (1, 2, 4, 8)), (4, (1, 2, 4, 8)), (8, (1, 2, 4, 8)), (16, (1, 2, 4, 8)))
"""(requests, tokens per request) of the batched forwards whose cost is measured."""
CONTEXT_TOKENS = 256
"""Tokens in each request's cache while the cost model is measured."""
LONG_CONTEXT = 2048
"""A second cache length, for the cost of each extra context token."""
BUSY_SHARE = 0.25
"""The share of the CPU time of the cores triedec's threads need that other processes may take
while the cost model is measured; above it the calibration counts as taken on a busy machine
(:class:`CpuWatch`)."""
CALIBRATION_FORMAT = "triedec-calibration-3"
FULL_REPEATS = CALIBRATION_EFFORTS[DEFAULT_CALIBRATION_EFFORT].repeats
"""The default effort's timed repeats (the measuring functions' default)."""
PROMPTS_FILE = Path(__file__).with_name("calibration_prompts.json")

log = logging.getLogger("triedec")


class Target(Protocol):
    """What calibration needs of a loaded model (a :class:`~triedec.api.lm.LM` is one)."""

    adapter: ModelAdapter
    eos_token_ids: frozenset[int]

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, prompt: Any, chat: bool = False) -> list[int]: ...

    def reference_model(self) -> Any: ...


@dataclass(frozen=True)
class Calibration:
    """One model on one device: its cost model and the method profiles measured so far."""

    model_id: str
    device: str
    dtype: str
    cost: CostModel
    profiles: Mapping[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def effort(self) -> str:
        """How much was measured: a name in :data:`~triedec.core.params.CALIBRATION_EFFORTS`, or
        ``custom`` (prompts, tokens or repeats given by hand). Files from before efforts were
        recorded were measured in full; an unknown name is read as ``custom``."""
        effort = self.details.get("effort", "full")
        return effort if effort in CALIBRATION_EFFORTS else "custom"

    @property
    def busy(self) -> bool:
        """Whether other processes took more than :data:`BUSY_SHARE` of the CPU time of the cores
        this process's threads needed while the cost model was measured (:class:`CpuWatch`; then it
        is measured again on the next load, or by an idle server: :func:`remeasure_cost`)."""
        share = self.details.get("others_cpu_share")
        return isinstance(share, (int, float)) and share > BUSY_SHARE

    def as_dict(self) -> dict[str, Any]:
        """Everything measured, as JSON-ready values (what :meth:`to_json` writes)."""
        specs = profile_specs()
        return {"format": CALIBRATION_FORMAT, "model_id": self.model_id, "device": self.device, "dtype": self.dtype,
                "cost": self.cost.as_dict(), "details": self.details,
                "profiles": {name: specs[name].dump(p) for name, p in self.profiles.items()}}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        try:
            data = json.loads(text)
            if data.get("format") != CALIBRATION_FORMAT:
                raise TriedecError(f"not a {CALIBRATION_FORMAT} file (format {data.get('format')!r})")
            specs = profile_specs()
            profiles = {name: specs[name].load(value) for name, value in data.get("profiles", {}).items()
                        if name in specs}
            return cls(data["model_id"], data["device"], data["dtype"], CostModel.from_dict(data["cost"]), profiles,
                       data.get("details", {}))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise TriedecError(f"unreadable calibration: {exc!r}") from exc


def device_key(adapter: ModelAdapter) -> str:
    """What a cost model depends on besides the model: the device (a GPU's name, or this host:
    :func:`~triedec.core.machine.host_key`), CPU threads, dtype and kernels (and the build of triedec's
    compiled ones, :attr:`~triedec.model.adapter.ModelAdapter.native_build`, so that a change to them is
    measured again), and in a quantized mode which layers are int4 and which int8
    (:func:`~triedec.model.precision.layer_mix`)."""
    device = adapter.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu-{host_key()}-{torch.get_num_threads()}threads"
    key = f"{name}-{str(adapter.dtype).removeprefix('torch.')}-{adapter.kernels}"
    if adapter.native_build:
        key += f"-build{adapter.native_build}"
    if adapter.precision.quantized:
        key += f"-{layer_mix(adapter.model)}"
    return "".join(c if c.isalnum() or c in "-." else "-" for c in key)


CALIBRATION_NAME_LIMIT = 200
"""The most characters of a calibration file's name before ``.json``: a file name is at most 255
bytes on the usual file systems, and the lock beside it and the atomic write's temporary file add
suffixes. A longer name (a long CPU name, kernels and layer mix) keeps its first characters and
ends in a digest of the whole."""


def calibration_path(cache_dir: Path, adapter: ModelAdapter) -> Path:
    """Where the calibration of this model on this device is cached: its model id and
    :func:`device_key`, cut to :data:`CALIBRATION_NAME_LIMIT` characters with a digest of the whole
    name where longer (the file itself holds the full key)."""
    name = f"{adapter.model_id}-{device_key(adapter)}"
    if len(name) > CALIBRATION_NAME_LIMIT:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        name = f"{name[:CALIBRATION_NAME_LIMIT - len(digest) - 1]}-{digest}"
    return cache_dir / "calibration" / f"{name}.json"


def read_calibration(cache_dir: Path, adapter: ModelAdapter) -> Calibration | None:
    """The cached calibration of this model on this device, or None when there is none or it is
    unreadable; measures nothing (``triedec calibrate --show``)."""
    path = calibration_path(cache_dir, adapter)
    if not path.is_file():
        return None
    try:
        return Calibration.from_json(path.read_text())
    except TriedecError:
        return None


# ---- the cost model -----------------------------------------------------------------------------


MAX_SIZE = 256


class Interrupted(Exception):
    """A measurement abandoned because its ``should_stop()`` said so (work arrived)."""



def _tree(size: int, gen: torch.Generator, vocab: int) -> TokenTree:
    """A random tree of ``size`` nodes: four children per node, breadth first (draft trees are
    wide near the root; a forward's cost hardly depends on the shape)."""
    if not 1 <= size <= MAX_SIZE:
        raise TriedecError(f"cost sizes must lie in [1, {MAX_SIZE}], got {size}")
    parents = (-1, *((i - 1) // 4 for i in range(1, size)))
    return TokenTree(tuple(torch.randint(vocab, (size,), generator=gen).tolist()), parents)


def measure_cost_model(lm: Target, sizes: Sequence[int] = TREE_SIZES,
                       batch: Sequence[tuple[int, Sequence[int]]] = BATCH_GRID,
                       context_tokens: int = CONTEXT_TOKENS, long_context: int = LONG_CONTEXT,
                       repeats: int = FULL_REPEATS, k: int = 8,
                       progress: Callable[[int, int], None] | None = None,
                       should_stop: Callable[[], bool] | None = None) -> CostModel:
    """Median seconds of forwards (module doc), each followed by the top-k of its logits that
    Token Recycling and auto do after every step. One request's cache is prefilled once; the other
    requests' caches and the long one are copies of it (what a forward costs does not depend on
    the values in the cache). ``progress(done, total)`` is called after every forward;
    ``should_stop()`` too, and when it says True the measurement is abandoned
    (:class:`Interrupted`): a server measuring between requests stops within one forward of a
    request's arrival."""
    positive_int("repeats", repeats)
    adapter = lm.adapter
    gen = torch.Generator().manual_seed(0)
    width = max([1, *(b for b, _ in batch)])
    room = context_tokens + max([*sizes, *(t for _, ts in batch for t in ts)])
    first = adapter.new_cache(max(room, long_context + 1))
    adapter.prefill(first, torch.randint(adapter.vocab_size, (context_tokens,), generator=gen))
    first.commit(range(context_tokens))
    caches = [first, *(first.clone() for _ in range(width - 1))]
    long = first.clone()
    long.extend_to(long_context)
    points: dict[tuple[int, int], list[TokenTree]] = {}
    for t in sizes:
        points[(1, t)] = [_tree(t, gen, adapter.vocab_size)]
    for b, per_request in batch:
        for t in per_request:
            points[(b, b * t)] = [_tree(t, gen, adapter.vocab_size) for _ in range(b)]
    times: dict[tuple[int, int] | str, list[float]] = {key: [] for key in points}
    times["long"] = []
    total, done = (repeats + 1) * (len(points) + 1), 0
    for round_ in range(repeats + 1):  # round 0 warms up
        for key, trees in [*points.items(), ("long", [_tree(1, gen, adapter.vocab_size)])]:
            targets = [long] if key == "long" else caches[: len(trees)]
            items = [ForwardItem(c, torch.tensor(tree.tokens), tree.positions(c.length)[0], tree.ancestry)
                     for c, tree in zip(targets, trees, strict=True)]
            start = time.perf_counter()
            for logits in adapter.forward_batch(items):
                logits.topk(k, dim=-1)
            adapter.synchronize()
            if round_:
                times[key].append(time.perf_counter() - start)
            for c in targets:
                c.commit([])
            done += 1
            if progress is not None:
                progress(done, total)
            if should_stop is not None and should_stop():
                raise Interrupted(f"stopped after {done} of {total} forwards")
    median = {key: statistics.median(v) for key, v in times.items()}
    forward = {t: median[(1, t)] for t in sizes}
    rows: dict[int, dict[int, float]] = {}
    for b, per_request in batch:
        rows[b] = {b * t: median[(b, b * t)] for t in per_request}
    one = median.get((1, 1), min(forward.values()))
    per_token = max(0.0, (median["long"] - one) / max(1, long_context - context_tokens))
    return CostModel(forward, context_tokens, {"repeats": repeats, "torch": torch.__version__,
                                               "threads": torch.get_num_threads(), "kernels": adapter.kernels,
                                               "long_context": long_context},
                     rows, per_token)


def measure_reference_forward(model: Any, vocab_size: int, sizes: Sequence[int] = (1, 16),
                              context_tokens: int = 512,
                              repeats: int = FULL_REPEATS) -> dict[int, float]:
    """Median seconds of stock transformers' own forward of T tokens (a causal chain) on a
    ``context_tokens`` cache, run as ``generate`` runs it (its default ``DynamicCache``): the
    yardstick the cost curve is read against. ``model`` is an unmodified transformers model."""
    from transformers import DynamicCache

    positive_int("repeats", repeats)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=model.config)
    passed = {cache_keyword(model): cache}
    times: dict[int, list[float]] = {t: [] for t in sizes}
    with torch.inference_mode():
        model(input_ids=torch.randint(vocab_size, (1, context_tokens), generator=gen).to(device),
              use_cache=True, **passed)
        for round_ in range(repeats + 1):  # round 0 warms up
            for t in sizes:
                ids = torch.randint(vocab_size, (1, t), generator=gen).to(device)
                start = time.perf_counter()
                model(input_ids=ids, use_cache=True, **passed)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if round_:
                    times[t].append(time.perf_counter() - start)
                cache.crop(-t)
    return {t: statistics.median(v) for t, v in times.items()}


# ---- profiles -----------------------------------------------------------------------------------


def calibration_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` (default: all) calibration prompts (``calibration_prompts.json`` beside this
    module: Spec-Bench first turns, one per category in turn, all in the benchmark's tuning split)."""
    prompts = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))["prompts"]
    if n is None:
        return prompts
    if not 1 <= n <= len(prompts):
        raise TriedecError(f"calibration has {len(prompts)} prompts; asked for {n}")
    return prompts[:n]


class Bench:
    """What a profile's ``measure`` gets (:class:`~triedec.drafters.registry.CalibrationBench`): the
    model's info with the cost model, calibration prompts and greedy decoding of one prompt alone
    with a drafter, drafts sized under that cost model."""

    def __init__(self, lm: Target, cost: CostModel, prompt_count: int, max_new_tokens: int) -> None:
        self.lm = lm
        adapter = lm.adapter
        self.info = ModelInfo(adapter.vocab_size, adapter.device, adapter.model_id, cost)
        self.prompt_count, self.max_new_tokens = prompt_count, max_new_tokens

    def prompts(self, count: int) -> list[list[int]]:
        return [self.lm.encode(p, chat=self.lm.has_chat_template) for p in calibration_prompts(count)]

    def decode(self, drafter: Drafter, prompt: Sequence[int], max_new_tokens: int) -> int:
        stop = StopRule(max_new_tokens=max_new_tokens, eos_token_ids=self.lm.eos_token_ids)
        run = Request(drafter, prompt, stop)
        return sum(len(new) for new in run_alone(self.lm.adapter, run, self.info.cost))


@contextlib.contextmanager
def _bar(description: str, unit: str) -> Iterator[Callable[[int, int], None]]:
    """A progress callback drawing a bar with an estimate of the time left on stderr (a terminal
    only: tqdm stays silent otherwise)."""
    from tqdm import tqdm

    with tqdm(desc=description, unit=unit, file=sys.stderr, dynamic_ncols=True, disable=None, leave=False) as bar:
        def advance(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        yield advance


def calibration_effort(name: str | None = None) -> str:
    """The effort to measure at: ``name`` if given, else the :data:`~triedec.core.params.CALIBRATION_EFFORT_ENV`
    environment variable, else :data:`~triedec.core.params.DEFAULT_CALIBRATION_EFFORT`."""
    chosen = name if name is not None else (os.environ.get(CALIBRATION_EFFORT_ENV, "").strip() or
                                            DEFAULT_CALIBRATION_EFFORT)
    if chosen not in CALIBRATION_EFFORTS:
        source = "effort" if name is not None else CALIBRATION_EFFORT_ENV
        raise TriedecError(f"{source} must be one of {', '.join(CALIBRATION_EFFORTS)}, got {chosen!r}")
    return chosen


def _serves(cached: Calibration, effort: str) -> bool:
    """Whether a cached calibration is good enough for one asked at ``effort``: a quick one serves
    only quick requests; a full or hand-sized one serves all."""
    return cached.effort != "quick" or effort == "quick"


def _read_usable(path: Path, effort: str, needs: frozenset[str], say: bool) -> tuple[Calibration | None, list[str]]:
    """The cached calibration at ``path`` if it can be used (readable, not measured busy, measured
    at an effort that serves ``effort``), and the profiles in ``needs`` it lacks. ``say``: log why
    a file is not used."""
    cached: Calibration | None = None
    if path.is_file():
        try:
            cached = Calibration.from_json(path.read_text())
        except TriedecError as exc:
            if say:
                log.info("ignoring the cached calibration %s (%s); measuring again", path, exc)
    if cached is not None and cached.busy:
        if say:
            log.warning("the cached calibration %s was measured while other processes took %.0f%% of the "
                        "CPU its threads needed; measuring it again", path, 100 * cached.details["others_cpu_share"])
        cached = None
    if cached is not None and not _serves(cached, effort):
        if say:
            log.info("the cached calibration %s was a quick one; measuring it in full", path)
        cached = None
    return cached, sorted(set(needs) - {NEEDS_COST} - set(cached.profiles if cached else ()))


@contextlib.contextmanager
def _measuring(path: Path) -> Iterator[None]:
    """Held while one process measures the calibration at ``path``: an exclusive lock on a file
    beside it (``.lock``, readable only by its owner), so that processes sharing the cache
    directory measure it once; the others wait here, then read what the first wrote. Where the
    platform has no ``fcntl`` it locks nothing."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def load_or_calibrate(lm: Target, cache_dir: Path, needs: frozenset[str] = frozenset({NEEDS_COST}),
                      force: bool = False, *, effort: str | None = None, prompts: int | None = None,
                      max_new_tokens: int | None = None, repeats: int | None = None) -> Calibration:
    """The cached calibration of ``lm`` on its device, with at least the parts in ``needs``
    (``"cost"``, and profile names); the missing parts (all of them if ``force``) are measured and
    the file is rewritten atomically. A file from an older triedec version, one measured busy, and
    a quick one when ``effort`` is full are measured anew. ``effort`` (default:
    :func:`calibration_effort`) sets ``prompts``, ``max_new_tokens`` and ``repeats``; any of them
    given replaces its value (the calibration's effort is then ``custom``). Measuring happens under
    a lock shared by the processes that use ``cache_dir`` (:func:`_measuring`). A forced calibration
    also times stock transformers' forward of 1 and 16 tokens on the same cache
    (``details["reference_forward_seconds"]``), next to triedec's."""
    specs = profile_specs()
    unknown = set(needs) - {NEEDS_COST} - set(specs)
    if unknown:
        raise TriedecError(f"nothing to calibrate for {sorted(unknown)}")
    name = calibration_effort(effort)
    given = {"prompts": prompts, "max_new_tokens": max_new_tokens, "repeats": repeats}
    plan: CalibrationEffort = dataclasses.replace(CALIBRATION_EFFORTS[name],
                                                  **{k: v for k, v in given.items() if v is not None})
    if plan != CALIBRATION_EFFORTS[name]:
        name = "custom"
    path = calibration_path(cache_dir, lm.adapter)
    if not force:
        cached, missing = _read_usable(path, name, needs, say=False)
        if cached is not None and not missing:
            return cached
    with _measuring(path):
        cached, missing = (None, sorted(specs)) if force else _read_usable(path, name, needs, say=True)
        if cached is not None and not missing:
            return cached  # another process measured it while this one waited
        started = time.perf_counter()
        if cached is None:
            log.info("measuring this device's cost model (once; cached in %s): best with nothing else running", path)
            key = (lm.adapter.model_id, device_key(lm.adapter), str(lm.adapter.dtype))
            with CpuWatch() as watch, _bar("calibrating: forward costs", "forward") as bar:
                cost = measure_cost_model(lm, repeats=plan.repeats, progress=bar)
            cached = Calibration(*key, cost, details={"others_cpu_share": watch.others_share, "effort": name})
            if cached.busy:
                log.warning("other processes took %.0f%% of the CPU its threads needed while the cost model was "
                            "measured: it is used for now, marked busy, and measured again on the next load",
                            100 * (watch.others_share or 0.0))
            if force:
                reference = measure_reference_forward(lm.reference_model(), lm.adapter.vocab_size,
                                                      repeats=plan.repeats)
                seconds = {str(t): v for t, v in reference.items()}
                cached = replace(cached, details={**cached.details, "reference_forward_seconds": seconds})
        bench = Bench(lm, cached.cost, plan.prompts, plan.max_new_tokens)
        profiles = dict(cached.profiles)
        for profile in missing:
            log.info("measuring %s's profile on this device (once; a minute or two)", profile)
            profiles[profile] = specs[profile].measure(bench)
        # a calibration is as good as its weakest part: quick below hand-sized below full
        effort_now = min((cached.effort, name), key=("quick", "custom", "full").index)
        cached = replace(cached, profiles=profiles,
                         details={**cached.details, "effort": effort_now,
                                  "seconds_taken": round(time.perf_counter() - started, 1)})
        _write(path, cached)
    return cached


def remeasure_cost(lm: Target, cache_dir: Path, calibration: Calibration, *, repeats: int | None = None,
                   should_stop: Callable[[], bool] | None = None, reason: str = "while idle") -> Calibration:
    """``calibration`` with its cost model measured again now (its profiles kept), under a
    :class:`~triedec.core.machine.CpuWatch`, and written atomically over the cached file: what a
    server does, between requests, with a calibration that was measured busy. ``repeats``
    defaults to the calibration's own effort's (a full one's for a ``custom`` one). Raises
    :class:`Interrupted` (and writes nothing) when ``should_stop()`` says so. ``reason`` is recorded
    in its details (``remeasured``)."""
    if repeats is None:
        repeats = CALIBRATION_EFFORTS.get(calibration.effort, CALIBRATION_EFFORTS[DEFAULT_CALIBRATION_EFFORT]).repeats
    started = time.perf_counter()
    with CpuWatch() as watch:
        cost = measure_cost_model(lm, repeats=repeats, should_stop=should_stop)
    fresh = replace(calibration, cost=cost, details={
        **calibration.details, "others_cpu_share": watch.others_share,
        "seconds_taken": round(time.perf_counter() - started, 1), "remeasured": reason})
    _write(calibration_path(cache_dir, lm.adapter), fresh)
    return fresh


SPOT_SHAPES = ((1, 1), (1, 8), (4, 4))
"""(requests, tokens in all) of the forwards :func:`spot_check` times: plain decoding's step, an
8-token tree, and a step of 4 requests."""
SPOT_TOLERANCE = 1.3
"""how far (as a ratio, either way) a spot-checked forward may sit from a cached cost model's
estimate before the cost model is measured again"""


def spot_check(lm: Target, cost: CostModel, repeats: int = 3) -> dict[str, float]:
    """Each :data:`SPOT_SHAPES` forward timed now (median of ``repeats`` after a warm-up, on caches
    of ``cost.context_tokens``, as the cost model was measured) over ``cost``'s estimate for it, by
    ``"requests x tokens"``. A ratio far from 1 means the cached surface no longer describes this
    machine: measured while something else ran without being caught, or before a change to the
    code around the kernels (where the weights live, how a step is run). Drafts sized under such a
    surface stay wrong where the engine never runs forwards to correct it
    (:class:`~triedec.core.costmodel.ObservedCost` corrects only the shapes it sees, and a surface that
    is too steep keeps trees too small to be seen): a few forwards at startup catch it."""
    sizes = sorted({t for b, t in SPOT_SHAPES if b == 1})
    batch = [(b, (t // b,)) for b, t in SPOT_SHAPES if b > 1]
    now = measure_cost_model(lm, sizes=sizes, batch=batch, context_tokens=cost.context_tokens,
                             long_context=cost.context_tokens + 1, repeats=repeats)
    return {f"{b}x{t}": now.seconds(t, b) / cost.seconds(t, b) for b, t in SPOT_SHAPES}


def stale(ratios: Mapping[str, float], tolerance: float = SPOT_TOLERANCE) -> bool:
    """Whether :func:`spot_check`'s ratios say the cached cost model is stale: any beyond
    ``tolerance`` either way."""
    return any(not 1 / tolerance <= r <= tolerance for r in ratios.values())


def _write(path: Path, calibration: Calibration) -> None:
    """``calibration`` as ``path``'s JSON, replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(calibration.to_json())
    os.replace(tmp, path)


class Calibrator:
    """The calibration one loaded model uses, over its life: read from ``cache_dir`` or measured
    the first time a method needs it (:meth:`get`), measured again on request
    (:meth:`recalibrate`), or its cost model again when it was measured on a busy machine
    (:meth:`remeasure_if_busy`). Thread-safe (one lock; a measurement runs under it, so it runs
    once)."""

    def __init__(self, target: Target, cache_dir: Path) -> None:
        self.target, self.cache_dir = target, cache_dir
        self._calibration: Calibration | None = None
        self._lock = threading.RLock()

    def get(self, needs: frozenset[str] = frozenset({NEEDS_COST})) -> Calibration:
        """A calibration with at least the parts in ``needs`` (``"cost"``, or a method's name for
        its profile): the one in use, else read from the cache directory or measured and cached."""
        with self._lock:
            cal = self._calibration
            if cal is None or not set(needs) - {NEEDS_COST} <= set(cal.profiles):
                self._calibration = load_or_calibrate(self.target, self.cache_dir, frozenset(needs))
            return self._calibration

    def recalibrate(self, **kwargs: Any) -> Calibration:
        """Measure the whole calibration again (:func:`load_or_calibrate`'s ``force``) and use it."""
        with self._lock:
            self._calibration = load_or_calibrate(self.target, self.cache_dir, frozenset({NEEDS_COST}), force=True,
                                                  **kwargs)
            return self._calibration

    def remeasure_if_busy(self, should_stop: Callable[[], bool] | None = None) -> bool:
        """Measure the cost model again if the calibration in use was taken on a busy machine
        (:func:`remeasure_cost`); True when the one in use is now a quiet one."""
        with self._lock:
            cal = self._calibration
            if cal is None or not cal.busy:
                return cal is not None
            self._calibration = remeasure_cost(self.target, self.cache_dir, cal, should_stop=should_stop)
            return not self._calibration.busy

    def check_cost(self) -> dict[str, float]:
        """Time a few forwards now against the cost model in use (:func:`spot_check`); where the
        surface is stale (:func:`stale`) twice in a row, measure the cost model again now
        (:func:`remeasure_cost`) and use that. Returns the ratios found (empty when no calibration is in use). What a
        server does at startup, before it serves."""
        with self._lock:
            cal = self._calibration
            if cal is None:
                return {}
            ratios = spot_check(self.target, cal.cost)
            if stale(ratios):  # timed once more before a whole measurement: one slow moment is not a stale surface
                ratios = spot_check(self.target, cal.cost)
            if stale(ratios):
                log.warning("the cached cost model does not match this machine now (measured / cached: %s); "
                            "measuring it again", ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
                with _measuring(calibration_path(self.cache_dir, self.target.adapter)):
                    self._calibration = remeasure_cost(self.target, self.cache_dir, cal,
                                                       reason="stale at startup: " + json.dumps(ratios))
            return ratios

    @property
    def loaded(self) -> Calibration | None:
        """The calibration in use (None if nothing needed one yet)."""
        return self._calibration
