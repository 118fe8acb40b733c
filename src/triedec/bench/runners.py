"""What the benchmark times: a :class:`Runner` per method, stock transformers' (:class:`HFRunner`,
``model.generate`` as a user runs it) and triedec's (:class:`TriedecRunner`, one
:class:`~triedec.api.generation.GenerationRequest` per run), each run's :class:`RunRecord`, and the
peak memory of one run (:func:`measured`)."""

from __future__ import annotations

import dataclasses
import gc
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from triedec.api.generation import GenerationRequest
from triedec.api.lm import LM
from triedec.core.sampling import GREEDY_SAMPLING, Sampling
from triedec.engine.methods import method as find_method
from triedec.model.adapter import returned_cache

REFERENCE = "hf-greedy"
"""The speed and token reference of a greedy run."""
SAMPLED_REFERENCE = "hf-sample"
"""The speed reference of a sampled run (transformers' ``generate(do_sample=True)``)."""
OWN_BASELINE = "ar"
"""triedec's own plain decoding: ``speedup_vs_ar`` is what the draft trees add on top of it, and
with sampling its tokens are the reference every method must equal."""


@dataclass(frozen=True)
class RunRecord:
    """One run of one method on one prompt."""

    tokens: list[int]
    seconds: float
    steps: int
    computed_tokens: int
    kv_bytes: int
    peak_mem_bytes: int = 0
    details: dict[str, Any] = field(default_factory=dict)


class Runner(Protocol):
    """A benchmarked method: ``run`` generates from prompt token ids, greedily or sampling with
    ``seed`` (None when greedy); ``reset`` forgets everything the method learned from earlier runs
    (it is not timed). ``comparable``: whether its tokens are checked against the token reference
    (transformers' own sampling is not: it draws from torch's RNG)."""

    label: str
    comparable: bool

    def run(self, prompt: list[int], max_new_tokens: int, seed: int | None = None) -> RunRecord: ...

    def reset(self) -> None: ...


class _ForwardCounter:
    """Counts forward calls and their input tokens through a forward pre-hook (public torch API)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.calls, self.tokens = model, 0, 0

    def __enter__(self) -> _ForwardCounter:
        self.handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls += 1
        self.tokens += int(ids.shape[-1]) if ids is not None else 0


@dataclass(frozen=True)
class HFGenerated:
    """One stock ``model.generate`` call: its output (``return_dict_in_generate``), wall-clock
    seconds, forward calls and tokens fed (prompt included), and the bytes of the KV it returned."""

    output: Any
    seconds: float
    forward_calls: int
    forward_tokens: int
    kv_bytes: int


def hf_generate(lm: LM, prompt: list[int], max_new_tokens: int, **kwargs: Any) -> HFGenerated:
    """Stock transformers ``generate`` on the unmodified model (``lm.reference_model()``), as a
    user would call it without triedec (its default cache), timed and with its forwards counted.
    ``kwargs`` go to ``generate``."""
    model = lm.reference_model()
    ids = torch.tensor([prompt], device=lm.device)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = next(iter(lm.eos_token_ids), 0)
    with _ForwardCounter(model) as counter, torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             pad_token_id=pad, return_dict_in_generate=True, **kwargs)
        lm.adapter.synchronize()
        seconds = time.perf_counter() - start
    kv = returned_cache(out)
    kv_bytes = sum(t.numel() * t.element_size() for layer in kv.layers for t in (layer.keys, layer.values)
                   if t is not None)
    return HFGenerated(out, seconds, counter.calls, counter.tokens, kv_bytes)


def hf_sampling_kwargs(sampling: Sampling) -> dict[str, Any]:
    """``generate`` arguments that decode as ``sampling`` does (every filter given explicitly, so
    nothing comes from the model's generation config)."""
    if sampling.greedy:
        return {"do_sample": False, "repetition_penalty": sampling.repetition_penalty}
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "min_p": sampling.min_p or None, "repetition_penalty": sampling.repetition_penalty}


def transformers_tokens_compared(lm: LM) -> bool:
    """Whether stock transformers' greedy tokens are the token reference: in float32 only. In
    another precision mode its attention breaks near-ties (bf16 logits have 8 significant bits)
    differently from triedec's, so triedec's own bit-exact ``ar`` is the reference there
    (``docs/precision.md``)."""
    return lm.adapter.precision.name == "float32"


class HFRunner:
    """Stock transformers ``generate``, greedy or sampling as ``sampling`` says (``hf-greedy``,
    ``hf-sample``), or with its prompt lookup (``extra``: ``prompt_lookup_num_tokens``). Sampling
    seeds torch's global RNG with the run's seed first."""

    def __init__(self, lm: LM, label: str, sampling: Sampling = GREEDY_SAMPLING, **extra: Any) -> None:
        self.lm, self.label, self.sampling, self.extra = lm, label, sampling, extra
        self.comparable = sampling.greedy and transformers_tokens_compared(lm)

    def reset(self) -> None:
        """Nothing to forget: transformers keeps no state between ``generate`` calls."""

    def run(self, prompt: list[int], max_new_tokens: int, seed: int | None = None) -> RunRecord:
        if not self.sampling.greedy:
            torch.manual_seed(seed or 0)
        done = hf_generate(self.lm, prompt, max_new_tokens, **hf_sampling_kwargs(self.sampling), **self.extra)
        tokens = done.output.sequences[0, len(prompt) :].tolist()
        return RunRecord(tokens, done.seconds, done.forward_calls - 1, done.forward_tokens - len(prompt), done.kv_bytes)


class TriedecRunner:
    """A triedec method with fixed options, through the public API (``LM.generate``), greedy or
    sampling as ``sampling`` says (its seed replaced by each run's). ``reset`` rebuilds the method
    on :meth:`LM.fresh` of the model: the same weights and calibration, no learned state. Options
    naming a learned-state file (``state_files``) point at a private copy, restored from the
    user's file at every reset, so state never flows from one reset to the next through the file
    and the user's file is never written."""

    comparable = True

    def __init__(self, lm: LM, label: str, method: str, options: dict[str, Any],
                 sampling: Sampling = GREEDY_SAMPLING, state_files: Sequence[str] = ()) -> None:
        self.base, self.label, self.method, self.sampling = lm, label, method, sampling
        self.options = dict(options)
        self.originals = {name: Path(str(options[name])) for name in state_files}
        self.scratch = tempfile.TemporaryDirectory(prefix="triedec-bench-") if state_files else None
        # what the method needs measured is loaded into the shared model first, so every fresh
        # copy starts from the same calibration (and the results record it)
        found = find_method(method)
        lm.model_info(found.needs(found.make_options(options)))
        self.reset()  # validates and builds now, before anything is timed

    def reset(self) -> None:
        for name, original in self.originals.items():
            assert self.scratch is not None
            copy = Path(self.scratch.name) / f"{name}-{original.name}"
            copy.unlink(missing_ok=True)
            if original.exists():
                shutil.copyfile(original, copy)
            self.options[name] = str(copy)
        self.lm = self.base.fresh()
        self.lm.decoder(self.method, **self.options)

    def run(self, prompt: list[int], max_new_tokens: int, seed: int | None = None) -> RunRecord:
        request = GenerationRequest(prompt, self.method, self.options, max_new_tokens,
                                    sampling=dataclasses.replace(self.sampling, seed=seed))
        start = time.perf_counter()
        out = self.lm.generate(request)
        self.lm.adapter.synchronize()
        seconds = time.perf_counter() - start
        s = out.stats
        details: dict[str, Any] = {k: v for k, v in s.as_dict().items() if k in ("acceptance_by_depth", "drafter")}
        details["kv_tokens"] = s.peak_kv_tokens
        if out.sequences:
            details["score"] = out.sequences[0].score
        return RunRecord(out.token_ids, seconds, s.steps, s.computed_tokens, s.kv_bytes, details=details)


# ---- memory -----------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measured(runner: Runner, prompt: list[int], max_new_tokens: int, device: torch.device,
             seed: int | None = None) -> RunRecord:
    """Run once (with ``seed`` when sampling) and record the peak memory increase over the run
    (GPU: allocated; CPU: RSS, with the kernel's peak-RSS counter reset before the run)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        rec = runner.run(prompt, max_new_tokens, seed)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM (peak RSS) to the current RSS
            base = _rss_kib("VmRSS")
        except OSError:
            base = None
        rec = runner.run(prompt, max_new_tokens, seed)
        peak = 0 if base is None else (_rss_kib("VmHWM") - base) * 1024
    return replace(rec, peak_mem_bytes=max(0, peak))
