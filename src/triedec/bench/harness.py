"""The benchmark protocol and its metrics.

Protocol (one process, one loaded model):
* the sample comes from the dataset's evaluation split; warm-up runs (untimed, every method) use
  prompts outside the sample (:func:`~triedec.bench.datasets.warmup_questions`);
* state, ``cold`` (the default): every method is reset before each timed run, so each run
  measures one request on its own; ``warm``: each repeat is one pass over the sample in file order
  from reset state (warm-up first), learned state carrying from prompt to prompt as in a server,
  never from one repeat to the next (no method drafts a prompt from its own earlier answer to it);
* order: for every prompt and every repeat, the methods run in a fresh random order, seeded
  (:meth:`BenchConfig.order`), recorded per sample (``order_positions``);
* ``repeats`` timed runs per prompt and method; a prompt's time is the median of its repeats;
* wall clock with ``time.perf_counter`` (plus ``torch.cuda.synchronize`` on GPU);
* speed is compared with the stock transformers baseline (``hf-greedy``; with sampling,
  ``hf-sample``) and with triedec's own ``ar``, both as Spec-Bench does (ratio of mean tokens/s)
  and paired per prompt (geometric mean and median of per-prompt speedups, with a 95% bootstrap
  interval over questions, the turns of one question drawn together, none under 10 questions;
  :mod:`triedec.bench.stats`);
* every method's tokens are compared with the token reference for the same prompt: ``hf-greedy``,
  or with sampling triedec's ``ar`` at the same seed (sampled text depends only on the seed, so any
  difference is a bug; transformers' own sampled runs draw from torch's RNG and are not compared);
  a mismatch is counted, and a method with mismatches is reported as wrong, never as fast; each
  greedy mismatch records its first differing position and stock transformers' top-2 logit gap
  there (``first_mismatch``), so a near-tie broken by another fp32 kernel can be told from a bug;
* with sampling, prompt k (counted from 0 over the run) is sampled with seed ``seed + k`` by every
  method, transformers' baselines included (``torch.manual_seed``);
* every sample records its output token ids (``tokens``, from the first repeat; ``repeats_identical``
  says whether every repeat gave the same);
* a method that raises is dropped from the run (its samples too, so every method left is compared
  on the same prompts), with the prompt and the error recorded (``failed``), and the others go on;
  a reference that raises ends the run, as nothing could be compared without it.

Metrics per method (overall and per category), as Spec-Bench computes them:
* ``tokens_per_s``: mean over samples of new tokens / seconds;
* ``speedup``: that mean divided by the reference's mean on the same samples (null if wrong);
* ``mean_accepted``: tokens produced by decoding steps / steps (the prefill's token excluded);
* ``steps``, ``new_tokens``, ``computed_tokens`` (tokens through the model, prompt excluded): sums;
  ``computed_per_token`` = computed / new tokens;
* ``verify_per_token`` (drafters that report ``verify_tokens``, i.e. lookahead): the tokens of the
  verification branch alone per new token, the quantity the lookahead trie-verification paper
  compares between its modes (the lookahead branch is the same in both);
* ``speedup_vs_ar``: the same ratio against triedec's own ``ar`` (what the draft trees add to
  triedec's plain decoding), when ``ar`` ran;
* ``repeated_4grams``: the mean share of an output's 4-grams that already occurred earlier in it
  (how repetitive the outputs are: a small model's greedy loops inflate every lookup method);
  ``prompt_copy_4grams``: the mean share of its 4-grams found in its prompt (copying, which
  prompt lookup and the context trie feed on);
* ``peak_mem_mb``: the largest peak-memory increase of one run (RSS on CPU, allocated on GPU);
* ``kv_mb``: the largest KV cache of one run (triedec: its preallocated buffers; transformers:
  the cache tensors it returns);
* ``acceptance_by_depth`` (triedec methods): per depth d, the mean over runs of the share of steps
  whose tree reached depth d that accepted at least d drafts;
* ``drafter``: the drafter's own counters after the method's last run (e.g. recycling's share of
  matrix rows filled).
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from triedec.api.lm import LM
from triedec.bench.datasets import Question
from triedec.bench.runners import OWN_BASELINE, REFERENCE, SAMPLED_REFERENCE, Runner, RunRecord, measured
from triedec.core.errors import TriedecError, positive_int
from triedec.core.sampling import GREEDY_SAMPLING, Sampling, process, seen_tokens, uniform

_log = logging.getLogger("triedec.bench")

# ---- protocol ---------------------------------------------------------------------------------

STATES = ("cold", "warm")


@dataclass(frozen=True)
class BenchConfig:
    """The run's protocol values (see the module doc); ``sampling`` (greedy by default) applies to
    every method, and a sampled run starts from ``sampling.seed`` (0 if None). ``warmup``: warm-up
    prompts (outside the sample) every method runs untimed; ``order_seed`` seeds the per-prompt
    method orders."""

    max_new_tokens: int = 256
    repeats: int = 1
    warmup: int = 1
    sampling: Sampling = GREEDY_SAMPLING
    state: str = "cold"
    order_seed: int = 0
    against_transformers: bool = True
    """Whether greedy tokens are judged against stock transformers' (float32) or against
    triedec's own ``ar`` (other precision modes; sampled runs always use ``ar``)."""

    def __post_init__(self) -> None:
        positive_int("--max-new-tokens", self.max_new_tokens)
        positive_int("--repeats", self.repeats)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise TriedecError(f"--warmup must be a non-negative integer, got {self.warmup!r}")
        if not isinstance(self.sampling, Sampling):
            raise TriedecError("sampling must be a triedec Sampling")
        if self.state not in STATES:
            raise TriedecError(f"--state must be one of {', '.join(STATES)}, got {self.state!r}")
        if isinstance(self.order_seed, bool) or not isinstance(self.order_seed, int):
            raise TriedecError(f"--order-seed must be an integer, got {self.order_seed!r}")

    @property
    def speed_reference(self) -> str:
        return REFERENCE if self.sampling.greedy else SAMPLED_REFERENCE

    @property
    def token_reference(self) -> str:
        return REFERENCE if self.sampling.greedy and self.against_transformers else OWN_BASELINE

    def seed(self, index: int) -> int | None:
        """The seed of the run's ``index``-th prompt (None when greedy)."""
        return None if self.sampling.greedy else (self.sampling.seed or 0) + index

    def order(self, labels: Sequence[str], prompt_index: int, repeat: int) -> list[str]:
        """The methods' order for one prompt and repeat: a fresh shuffle, seeded by
        (``order_seed``, prompt index, repeat), so a run's orders are random yet reproducible."""
        shuffled = list(labels)
        random.Random(f"{self.order_seed}:{prompt_index}:{repeat}").shuffle(shuffled)
        return shuffled


def sample_id(q: Question, turn: int) -> str:
    """A prompt's id in the results: the question's, with ``-turnN`` for multi-turn questions."""
    return q.id if len(q.turns) == 1 else f"{q.id}-turn{turn + 1}"


def run_benchmark(
    lm: LM,
    runners: Sequence[Runner],
    questions: Sequence[Question],
    config: BenchConfig,
    progress: Callable[[int], Any] | None = None,
    warmup: Sequence[Question] = (),
) -> tuple[list[dict], list[dict], list[dict]]:
    """Run the protocol; return ``(samples, skipped, failed)``: one sample per prompt and method,
    the prompts skipped (beyond the model's context), and the methods dropped because they raised
    (``method``, ``prompt``, ``error``; the speed and token references are never dropped: their
    error ends the run). The references (:class:`BenchConfig`) must be among ``runners``;
    ``warmup`` questions (first turns, outside the sample) are run untimed by every method.

    * ``cold``: every runner is reset before each of its timed runs (nothing learned carries from
      one prompt, or one repeat, to the next); warm-up runs once, before the sample.
    * ``warm``: each repeat is a pass over the whole sample in file order from reset state,
      warm-up prompts first; learned state carries from prompt to prompt within a pass, never from
      a pass to the next, so no method sees a timed prompt twice.

    ``progress(total)`` may return an object with ``update(n)`` and ``set_description(s)``.
    """
    labels = [r.label for r in runners]
    for wanted in (config.speed_reference, config.token_reference):
        if wanted not in labels:
            raise TriedecError(f"the reference {wanted!r} must be among the methods")
    if len(set(labels)) != len(labels):
        raise TriedecError(f"methods listed twice: {labels}")
    by_label = {r.label: r for r in runners}
    chat = lm.has_chat_template
    total = sum(len(q.turns) for q in questions) * len(runners) * config.repeats
    bar = progress(total) if progress else None
    warm_prompts = [lm.encode(_messages([], q.turns[0], chat)) for q in warmup]
    records: dict[str, dict[str, list[RunRecord]]] = {}
    orders: dict[str, list[list[str]]] = {}
    prompts: dict[str, tuple[Question, int, list[int], int | None]] = {}
    skipped: dict[str, dict] = {}
    failed: dict[str, dict] = {}
    references = {config.speed_reference, config.token_reference}

    def attempt(label: str, where: str, work: Callable[[], Any]) -> Any:
        """``work()``, or None once ``label`` has failed (now or before): a method's error drops
        that method, a reference's ends the run."""
        if label in failed:
            return None
        try:
            return work()
        except Exception as exc:
            if label in references:
                raise
            failed[label] = {"method": label, "prompt": where, "error": f"{type(exc).__name__}: {exc}"}
            _log.warning("%s failed on %s (%s: %s); dropped from this run, the other methods go on",
                         label, where, type(exc).__name__, exc)
            return None

    def warm_up() -> None:
        for prompt in warm_prompts:
            for runner in runners:
                attempt(runner.label, "warm-up", lambda r=runner, p=prompt: r.run(
                    p, min(config.max_new_tokens, 32), config.seed(0)))

    def timed(key: str, index: int, prompt: list[int], seed: int | None, repeat: int) -> None:
        order = config.order(labels, index, repeat)
        orders.setdefault(key, []).append(order)
        for label in order:
            runner = by_label[label]
            if bar:
                bar.set_description(f"{key} {label}")

            def run(runner: Runner = runner) -> RunRecord:
                if config.state == "cold":
                    runner.reset()
                return measured(runner, prompt, config.max_new_tokens, lm.device, seed)

            record = attempt(label, key, run)
            if record is not None:
                records.setdefault(key, {}).setdefault(label, []).append(record)
            if bar:
                bar.update(1)

    def walk(repeats: Sequence[int]) -> None:
        index = 0
        for q in questions:
            history: list[dict[str, str]] = []
            for turn_index, turn in enumerate(q.turns):
                key = sample_id(q, turn_index)
                prompt = lm.encode(_messages(history, turn, chat))
                seed = config.seed(index)
                if lm.max_context is not None and len(prompt) + config.max_new_tokens > lm.max_context:
                    skipped[key] = {"id": q.id, "turn": turn_index, "prompt_tokens": len(prompt), "why": "context"}
                    if bar:
                        bar.update(len(runners) * len(repeats) * (len(q.turns) - turn_index))
                    break
                prompts[key] = (q, turn_index, prompt, seed)
                for repeat in repeats:
                    timed(key, index, prompt, seed, repeat)
                index += 1
                if chat:
                    answer = records[key][config.token_reference][-1].tokens
                    history += [{"role": "user", "content": turn},
                                {"role": "assistant", "content": lm.tokenizer.decode(answer, skip_special_tokens=True)}]

    if config.state == "cold":
        warm_up()
        walk(range(config.repeats))
    else:
        for repeat in range(config.repeats):
            for runner in runners:
                runner.reset()
            warm_up()
            walk([repeat])
    if bar and hasattr(bar, "close"):
        bar.close()
    kept = [r for r in runners if r.label not in failed]
    samples = [_sample(lm, key, *prompts[key], records[key], orders[key], kept, config) for key in prompts]
    return [s for group in samples for s in group], list(skipped.values()), list(failed.values())


def _sample(lm: LM, key: str, q: Question, turn: int, prompt: list[int], seed: int | None,
            records: dict[str, list[RunRecord]], orders: list[list[str]], runners: Sequence[Runner],
            config: BenchConfig) -> list[dict]:
    """One prompt's rows, one per method."""
    reference = records[config.token_reference][0].tokens
    rows = []
    for runner in runners:
        label, recs = runner.label, records[runner.label]
        first = recs[0]
        identical = all(r.tokens == reference for r in recs) if runner.comparable else None
        differing = next((r.tokens for r in recs if r.tokens != reference), None) if identical is False else None
        diagnosis = {} if differing is None else {
            "first_mismatch": first_mismatch(lm, prompt, reference, differing, config.sampling, seed)}
        rows.append({
            "id": key,
            "question": q.id,
            "category": q.category,
            "turn": turn + 1,
            "turns": len(q.turns),
            "method": label,
            "new_tokens": len(first.tokens),
            "seconds": statistics.median(r.seconds for r in recs),
            "seconds_all": [r.seconds for r in recs],
            "order_positions": [order.index(label) for order in orders],
            "steps": first.steps,
            "steps_all": [r.steps for r in recs],
            "computed_tokens": first.computed_tokens,
            "computed_all": [r.computed_tokens for r in recs],
            "identical_to_reference": identical,
            "repeats_identical": all(r.tokens == first.tokens for r in recs),
            "seed": seed,
            "repeated_4grams": repeated_ngram_share(first.tokens),
            "prompt_copy_4grams": prompt_copy_share(first.tokens, prompt),
            "prompt_tokens": len(prompt),
            "peak_mem_mb": max(r.peak_mem_bytes for r in recs) / 2**20,
            "kv_mb": max(r.kv_bytes for r in recs) / 2**20,
            **recs[-1].details,
            **diagnosis,
            "tokens": first.tokens,
        })
    return rows


def repeated_ngram_share(tokens: Sequence[int], n: int = 4) -> float:
    """The share of the output's n-grams that already occurred earlier in it (0 = no repetition;
    a greedy loop approaches 1). Lookup drafters gain from exactly this."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / len(grams) if grams else 0.0


def prompt_copy_share(tokens: Sequence[int], prompt: Sequence[int], n: int = 4) -> float:
    """The share of the output's n-grams that occur in the prompt (its context: system text,
    earlier turns, documents), i.e. how much of the answer copies its input. Prompt lookup and the
    context trie gain from exactly this."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    source = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    return sum(g in source for g in grams) / len(grams)


def first_mismatch(lm: LM, prompt: list[int], reference: list[int], tokens: list[int],
                   sampling: Sampling = GREEDY_SAMPLING, seed: int | None = None) -> dict[str, Any]:
    """Where ``tokens`` first leave ``reference``, and how close the decision there was under stock
    transformers' logits (the unmodified model) at that position:

    * greedy: ``top2_gap``, the gap between the top two logits; a gap near fp32 rounding (~1e-4)
      is a near-tie that another kernel may break either way; a large gap is a bug;
    * sampling: ``cdf_margin``, the distance from the draw's uniform number (scaled to the total
      mass) to the nearest edge of the reference token's interval of the processed CDF; a margin
      near fp32 noise (~1e-5 or less) is a draw that another batch shape may put on the other side
      of the boundary; a large margin is a bug."""
    i = next((j for j, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b),
             min(len(reference), len(tokens)))
    out: dict[str, Any] = {"position": i, "reference_token": reference[i] if i < len(reference) else None,
                           "token": tokens[i] if i < len(tokens) else None}
    model = lm.reference_model()
    with torch.inference_mode():
        ids = torch.tensor([[*prompt, *reference[:i]]], device=lm.device)
        logits = model(input_ids=ids).logits[0, -1].float()
    if sampling.greedy:
        top = logits.topk(2).values
        out["top2_gap"] = float(top[0] - top[1])
        return out
    if i < len(reference) and seed is not None:
        row = process(logits.cpu(), seen_tokens([*prompt, *reference[:i]]), sampling)
        cdf = torch.cumsum(torch.softmax(row.double(), dim=-1), dim=-1)
        target = uniform(seed, i) * float(cdf[-1])
        token = reference[i]
        low = float(cdf[token - 1]) if token else 0.0
        out["cdf_margin"] = min(abs(target - low), abs(float(cdf[token]) - target))
    return out


def _messages(history: list[dict[str, str]], turn: str, chat: bool) -> list[dict[str, str]] | str:
    if not chat:  # a base model: plain text, turns concatenated
        return "\n\n".join([m["content"] for m in history] + [turn])
    return [*history, {"role": "user", "content": turn}]


