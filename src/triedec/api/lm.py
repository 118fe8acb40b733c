"""The public API: a loaded model with ``generate``, ``stream`` and ``generate_batch``."""

from __future__ import annotations

import copy
import dataclasses
import os
import secrets
import sys
import threading
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from triedec.api.calibration import Calibration, Calibrator
from triedec.api.decoders import BuiltMethods, DecoderLimits
from triedec.api.generation import DEFAULT_METHOD, GenerationRequest, Prompt, vars_of
from triedec.api.grammar import Grammars
from triedec.api.prompts import Prompts
from triedec.core.costmodel import CostModel
from triedec.core.errors import TriedecError
from triedec.core.logprobs import TokenLogprob
from triedec.core.paths import cache_root
from triedec.core.prefixtrie import PrefixTrie
from triedec.drafters import ModelInfo
from triedec.drafters.learned import Learned
from triedec.drafters.registry import NEEDS_COST, keyword_names, reserve_option_names
from triedec.engine.batch import Batch, BatchLimits, run_alone
from triedec.engine.beam import Hypothesis
from triedec.engine.methods import Decoder
from triedec.engine.methods import method as find_method
from triedec.engine.outcome import Outcome, Stats
from triedec.engine.runs import Run
from triedec.model.adapter import ModelAdapter


@dataclass(frozen=True)
class GenerationResult:
    """``text``: the decoded new tokens (cut right after a stop string, if one ended generation);
    ``token_ids``: the new tokens only; ``stats``: counters and timings; ``logprobs``: each new
    token's :class:`~triedec.core.logprobs.TokenLogprob` when asked for. Beam search also returns
    ``sequences``: the ``num_return_sequences`` best hypotheses with their scores, best first
    (``token_ids`` is the first one's)."""

    text: str
    token_ids: list[int]
    stats: Stats
    sequences: tuple[Hypothesis, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    """one per token of ``token_ids`` when the request asked for them (``logprobs=k``), else empty"""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """with ``prompt_logprobs=True``: one per prompt token after the first, each scored after the
    tokens before it, else empty"""


class LM:
    """A loaded causal LM. ``model`` and ``tokenizer`` are the plain transformers objects.

    The LM is the front door (:meth:`start`, :meth:`generate`, :meth:`stream`,
    :meth:`generate_batch`) over parts that each do one job: :attr:`prompts` (tokenizer and chat
    template, :mod:`triedec.api.prompts`), :attr:`adapter` (the model's forward,
    :mod:`triedec.model.adapter`), :attr:`calibrator` (the device calibration's lifecycle,
    :class:`~triedec.api.calibration.Calibrator`) and :attr:`methods` (the built methods and their
    learned-state exchange, :class:`~triedec.api.decoders.BuiltMethods`); its other methods are
    shortcuts to them.

    Each method is built once per options value and kept for the life of this object, so learned
    drafter state (Token Recycling's matrix, agreement rates, auto's store) stays warm across
    requests; all per-request state lives in the request that :meth:`start` returns (and that
    :meth:`stream` decodes), so overlapping streams (threads, a server) do not disturb each other.
    ``limits`` bound the engine's batches (:class:`~triedec.core.limits.BatchLimits`).
    """

    def __init__(self, model: Any, tokenizer: Any, cache_dir: str | os.PathLike[str] | None = None,
                 kernels: str = "plain", reference: Callable[[], Any] | None = None,
                 limits: BatchLimits | None = None, decoders: DecoderLimits | None = None) -> None:
        """``kernels="auto"`` speeds ``model`` up in place where it applies (see
        :mod:`triedec.model.adapter`); the default keeps the model's own kernels. ``reference`` loads a
        stock copy of the model for :meth:`reference_model` (``triedec.load`` passes one).
        ``decoders`` bounds the methods kept built (:mod:`triedec.api.decoders`)."""
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = ModelAdapter(model, kernels)
        self.limits = limits or BatchLimits()
        self._reference_loader = reference
        self._reference: Any = None
        self._reference_lock = threading.Lock()
        self.cache_dir = cache_root(cache_dir)
        self.methods = BuiltMethods(decoders)
        """(scope, method, options) -> built decoder, least recently used first"""
        self.calibrator = Calibrator(self, self.cache_dir)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is None:
            gen_eos = tokenizer.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            [] if gen_eos is None else ([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        )
        self.max_context: int | None = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.prompts = Prompts(tokenizer, self.adapter.vocab_size)
        self.grammars = Grammars(tokenizer, self.adapter.vocab_size, self.eos_token_ids)
        """the requests' grammars, compiled once each (:mod:`triedec.api.grammar`)"""
        self.prefix_cache: PrefixTrie | None = None
        """KV kept across this LM's requests (:class:`~triedec.core.prefixtrie.PrefixTrie`; None,
        the default: none): set one, e.g. ``lm.prefix_cache = PrefixTrie(256 << 20)``, and
        :meth:`generate`, :meth:`stream` and :meth:`generate_batch` start each request from the
        longest cached prefix of its prompt and leave its KV there (the same bits as without;
        ``triedec serve`` keeps its own, ``--prefix-cache-mib``)"""

    @property
    def has_chat_template(self) -> bool:
        return self.prompts.has_chat_template

    # ---- calibration --------------------------------------------------------------------------

    def calibration(self, needs: frozenset[str] = frozenset({NEEDS_COST})) -> Calibration:
        """This model's device calibration with at least the parts in ``needs`` (``"cost"``: the
        cost model, under a minute; a method's name: its profile, e.g. ``"recycling"``, a minute
        or two): read from the cache directory, or measured once and cached. See
        :mod:`triedec.api.calibration`."""
        return self.calibrator.get(needs)

    def recalibrate(self, **kwargs: Any) -> Calibration:
        """Measure the whole calibration again (``effort``, ``prompts``, ``max_new_tokens``,
        ``repeats``: :func:`~triedec.api.calibration.load_or_calibrate`) and cache it. Methods
        already built keep what they were built with."""
        return self.calibrator.recalibrate(**kwargs)

    def remeasure_if_busy(self, should_stop: Callable[[], bool] | None = None) -> bool:
        """If the calibration in use was measured while other processes took the CPU its threads
        needed (:attr:`~triedec.api.calibration.Calibration.busy`), measure its cost model again now
        and use it (profiles kept; :func:`~triedec.api.calibration.remeasure_cost`): what the server
        does when it has been idle a while. True when the calibration in use is now a quiet one;
        raises :class:`~triedec.api.calibration.Interrupted` when ``should_stop()`` says so. The
        engine sizes drafts under the new cost model from its next step; methods already built
        keep what they were built with."""
        return self.calibrator.remeasure_if_busy(should_stop)

    def loaded_calibration(self) -> Calibration | None:
        """The calibration loaded or measured so far (None if nothing needed one yet)."""
        return self.calibrator.loaded

    def cost_model(self) -> CostModel | None:
        """The device's cost model the engine sizes drafts under, once any built method needed it
        (None before: drafts are then sized as for a flat curve)."""
        cal = self.calibrator.loaded
        return None if cal is None else cal.cost

    def model_info(self, needs: frozenset[str] = frozenset()) -> ModelInfo:
        """What drafters get to know about this model (see :class:`~triedec.drafters.ModelInfo`),
        with the measured values in ``needs`` loaded or measured first."""
        info = ModelInfo(self.adapter.vocab_size, self.adapter.device, self.adapter.model_id)
        if not needs:
            return info
        cal = self.calibration(needs)
        return dataclasses.replace(info, cost=cal.cost, profiles=dict(cal.profiles))

    def fresh(self) -> LM:
        """This model without any learned state: the same weights, tokenizer and calibration, no
        built methods (a benchmark measures each phase from fresh state this way)."""
        other = copy.copy(self)
        other.methods = BuiltMethods(self.methods.limits)
        return other

    # ---- prompts ------------------------------------------------------------------------------

    def encode(self, prompt: Prompt, chat: bool = False, split_special: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None, most: int | None = None) -> list[int]:
        """Token ids for a string (plain tokenization, or the chat template if ``chat``), a list
        of chat messages (the chat template), or a list of token ids (used as is).
        ``split_special``: special tokens' text inside strings, messages and tools is tokenized as
        plain text, so only the chat template makes control tokens (:mod:`triedec.api.prompts`);
        ``tools``: functions the chat template shows the model (OpenAI's ``tools`` shape;
        :mod:`triedec.api.tools`); ``most``: a prompt of more tokens is refused
        (:class:`~triedec.api.prompts.PromptTooLong`) without tokenizing all of a long text."""
        return self.prompts.encode(prompt, chat, split_special, tools, most)

    def decode_result(self, tokens: Sequence[int], stop: str | Sequence[str] | None = None) -> str:
        """Text of ``tokens`` (special tokens skipped), cut right after the first stop string."""
        return self.prompts.decode_result(tokens, stop)

    # ---- generation ---------------------------------------------------------------------------

    def decoder(self, method_name: str, *, scope: Hashable = None, **options: object) -> Decoder:
        """The method ``method_name`` built with ``options`` (once per options value and
        ``scope``; what it needs measured is loaded or measured first); bad names or values raise.

        ``scope`` keeps learned state apart: each scope has its own built methods, so requests of
        one scope never draft from what another's taught (the server's tenants; None is the
        default scope). The calibration is shared by every scope. Built methods are kept in an
        LRU bounded per scope and overall, in count and in learned-state bytes
        (:mod:`triedec.api.decoders`); a method whose bound alone exceeds a cap raises."""
        found = find_method(method_name)
        opts = found.make_options(options)
        return self.methods.get_or_build((scope, method_name, opts),
                                         lambda: found.build(opts, self.model_info(found.needs(opts))))

    def limit_decoders(self, limits: DecoderLimits) -> None:
        """Keep the methods built from now on within ``limits`` (:mod:`triedec.api.decoders`; the
        server passes its ``--max-methods*`` and ``--max-learned-mib*`` flags); the bounds are
        applied at the next build."""
        self.methods.set_limits(limits)

    def is_built(self, method_name: str, *, scope: Hashable = None, **options: object) -> bool:
        """Whether :meth:`decoder` would return a method already built (no measuring, no
        building); bad names or values raise."""
        found = find_method(method_name)
        return (scope, method_name, found.make_options(options)) in self.methods

    def forget(self, scope: Hashable) -> int:
        """Drop the methods built for ``scope`` and their learned state (a request still running
        keeps its method until it ends; learned-state files are written by the engine as
        usual); returns how many were dropped."""
        return self.methods.forget(scope)

    def export_learned(self) -> list[tuple[Hashable, str, str, Learned]]:
        """What every built method learned here since the last call, as (scope, method name,
        :func:`~triedec.api.decoders.options_id`, learned), empty values included (every scope this LM holds is listed).
        For exchanging learned state between replicas (:mod:`triedec.drafters.learned`,
        :mod:`triedec.server.sharing`); call it on the thread that runs the engine (it may run
        torch ops)."""
        return self.methods.export_learned()

    def absorb_learned(self, scope: Hashable, method_name: str, options: str, learned: Learned) -> int:
        """Merge another replica's ``learned`` into the methods built for ``scope`` whose name is
        ``method_name`` and whose :func:`~triedec.api.decoders.options_id` is ``options``; returns how many took it (0:
        none is built here). Malformed state raises :class:`~triedec.core.errors.TriedecError`."""
        return self.methods.absorb_learned(scope, method_name, options, learned)

    def start(self, request: GenerationRequest, *, scope: Hashable = None) -> Run:
        """The one entry point: ``request``'s run, checked against this model and ready for an
        engine :class:`~triedec.engine.batch.Batch` (the server's scheduler submits these). ``scope``
        says whose learned state the method drafts from and teaches (:meth:`decoder`). Every check
        runs before anything does; building the method may measure the device first. A sampling
        request without a seed gets a fresh one here (reported in ``stats.seed``)."""
        if not isinstance(request, GenerationRequest):
            raise TriedecError(f"start takes a GenerationRequest, got {type(request).__name__} "
                               "(build one with GenerationRequest.of(prompt, method, ...))")
        prompt_ids = self.prompts.tokens(request.prompt, chat=request.chat)  # its shape was checked when built
        rule, documents = self.prompts.prepare(request, len(prompt_ids), self.eos_token_ids, self.max_context)
        sampling = request.sampling
        if not sampling.greedy and sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
        constraint = None if request.grammar is None else self.grammars.state(request.grammar)
        decoder = self.decoder(request.method, scope=scope, **vars_of(request.options))
        return decoder.start(prompt_ids, rule, documents, sampling, request.logprobs, constraint)

    def stream(self, prompt: Prompt | GenerationRequest, method: str = DEFAULT_METHOD,
               **kwargs: Any) -> Generator[list[int], None, Outcome]:
        """Yield new token ids as they are accepted (several per step when drafts are accepted;
        with ``method="beam"``, the best hypothesis's tokens once no live beam can change them).
        Takes a :class:`~triedec.api.generation.GenerationRequest`, or :meth:`generate`'s arguments
        but ``on_tokens``.

        The generator's return value (``StopIteration.value``) is an
        :class:`~triedec.engine.outcome.Outcome` (stats, and beam search's ranked sequences);
        :meth:`generate` collects it for you. All input is validated before anything runs. The
        request runs alone in an engine batch of its own: the same step as the server's.
        """
        run = self.start(_request(prompt, method, kwargs))
        return run_alone(self.adapter, run, self.cost_model(), self.limits, self.prefix_cache)

    def generate(self, prompt: Prompt | GenerationRequest, method: str = DEFAULT_METHOD, *,
                 on_tokens: Callable[[list[int]], None] | None = None, **kwargs: Any) -> GenerationResult:
        """Generation with ``method`` (``triedec methods`` lists them and their options): a
        speculative method, or beam search with ``method="beam"`` and
        :class:`~triedec.engine.beam.BeamOptions` (``num_beams``, ``length_penalty``, ``early_stopping``,
        ``num_return_sequences``, ``gc_every``). ``prompt`` may be a whole
        :class:`~triedec.api.generation.GenerationRequest` instead; otherwise the keyword arguments are
        :meth:`GenerationRequest.of <triedec.api.generation.GenerationRequest.of>`'s:
        ``max_new_tokens`` (default 256), ``stop``, ``stop_token_ids``, ``context``, ``chat``,
        the sampling parameters, and the method's options.

        Output is token-for-token what greedy autoregressive decoding gives (beam search: what
        transformers' beam search gives). ``stop`` strings and
        ``stop_token_ids`` end generation like EOS does (the stopping token is kept, nothing
        after it). ``context`` holds extra documents that context-based drafters may draft from.
        ``on_tokens`` is called with each batch of newly accepted token ids.

        Sampling (:class:`~triedec.core.sampling.Sampling`; transformers' names and meanings):
        ``temperature`` > 0 samples (0, the default, is greedy), filtered by ``top_k``, ``top_p``
        and ``min_p``, with ``repetition_penalty`` over each token's own prefix. The token at output
        position i is drawn with a uniform number that depends only on ``(seed, i)``, so every
        method returns ``ar``'s tokens for the same ``seed``, and a rerun reproduces them. Without
        a ``seed`` one is drawn and reported in ``stats.seed``.

        ``logprobs=k`` (0-20) returns each new token's logprob and its k most likely alternatives
        in ``result.logprobs``: by default (``logprobs_mode="raw"``) ``torch.log_softmax`` of the
        model's float32 logits, with ``"processed"`` the distribution the token was chosen from.
        They come from the rows the step verified (no extra forward), so every method returns
        ``ar``'s values, bit for bit. ``prompt_logprobs=True`` scores the prompt's tokens too
        (``result.prompt_logprobs``, from the prefill's rows). Beam search reports none.
        """
        request = _request(prompt, method, kwargs)
        run = self.start(request)
        steps = run_alone(self.adapter, run, self.cost_model(), self.limits, self.prefix_cache)
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        while True:
            try:
                new = next(steps)
            except StopIteration as done:
                outcome = done.value
                break
            tokens += new
            logprobs += run.take_logprobs()
            if on_tokens is not None:
                on_tokens(new)
        return _result(self.decode_result(tokens, request.stop), tokens, outcome, request, logprobs)

    def generate_batch(self, prompts: Sequence[Prompt | GenerationRequest], method: str = DEFAULT_METHOD, *,
                       progress: bool = True, max_running: int | None = None,
                       **kwargs: Any) -> list[GenerationResult]:
        """:meth:`generate` for many prompts (or :class:`~triedec.api.generation.GenerationRequest`
        values) at once, with the same options for all of them:
        they are decoded together by one engine batch (one forward per step for all running
        requests, drafts sized together; at most ``max_running`` at once, default the LM's
        limits), and returned in input order. Each result equals what :meth:`generate` returns
        for that prompt alone (greedy: the same tokens; sampling: the same seed gives the same
        tokens; a sampling request without a seed gets one per prompt). Every prompt is
        validated before anything runs. ``progress`` shows a progress bar (stderr) of finished
        requests and tokens."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise TriedecError("generate_batch takes a list of prompts")
        if "on_tokens" in kwargs:
            raise TriedecError("generate_batch takes no on_tokens; use stream() for one request")
        requests = [_request(p, method, kwargs) for p in prompts]
        runs = [self.start(r) for r in requests]
        limits = self.limits if max_running is None else dataclasses.replace(self.limits, max_running=max_running)
        batch = Batch(self.adapter, self.cost_model(), limits, prefix=self.prefix_cache)
        tokens: list[list[int]] = [[] for _ in runs]
        logprobs: list[list[TokenLogprob]] = [[] for _ in runs]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(runs), unit="request", file=sys.stderr, dynamic_ncols=True, desc="generate_batch")
        try:
            for run in runs:
                batch.submit(run)
            produced = 0
            while not batch.idle:
                finished = batch.step().finished
                for i, run in enumerate(runs):
                    fresh = run.take()
                    tokens[i] += fresh
                    logprobs[i] += run.take_logprobs()
                    produced += len(fresh)
                if bar is not None:
                    bar.update(len(finished))
                    bar.set_postfix(tokens=produced, running=len(batch.running), refresh=False)
        finally:
            batch.close()
            if bar is not None:
                bar.close()
        return [_result(self.decode_result(t, r.stop), t, run.outcome, r, lp)
                for t, lp, r, run in zip(tokens, logprobs, requests, runs, strict=True)]

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    def reference_model(self) -> Any:
        """Stock transformers' model, unmodified, as a user would run it without triedec: the
        benchmark's baselines and the tests' ground truth. It is ``model`` itself when the kernels
        are plain, else a second copy loaded once (the loaded ``model`` runs faster kernels)."""
        if self.adapter.kernels == "plain":
            return self.model
        with self._reference_lock:
            if self._reference is None:
                if self._reference_loader is None:
                    raise TriedecError("this LM's model runs triedec's kernels and no stock copy can be loaded; "
                                       "load it with triedec.load(...) or kernels='plain'")
                self._reference = self._reference_loader()
            return self._reference


# the keyword forms' own keywords (GenerationRequest.of reserves the ones it shares with them)
for _form in (LM.generate, LM.stream, LM.generate_batch):
    reserve_option_names(keyword_names(_form, "prompt", "prompts"), f"LM.{_form.__name__}")
del _form


def _result(text: str, tokens: list[int], outcome: Outcome, request: GenerationRequest,
            logprobs: Sequence[TokenLogprob]) -> GenerationResult:
    """A finished run's result; with prompt logprobs, the prompt's come first in ``logprobs``."""
    scored = outcome.stats.prompt_tokens - 1 if request.logprobs is not None and request.logprobs.prompt else 0
    return GenerationResult(text, tokens, outcome.stats, outcome.sequences, tuple(logprobs[scored:]),
                            tuple(logprobs[:scored]))


def _request(prompt: Prompt | GenerationRequest, method: str, kwargs: Mapping[str, Any]) -> GenerationRequest:
    """A request given whole, or built from the keyword form."""
    if isinstance(prompt, GenerationRequest):
        if kwargs or method != DEFAULT_METHOD:
            raise TriedecError("pass either a GenerationRequest or a prompt with keyword arguments, not both")
        return prompt
    return GenerationRequest.of(prompt, method, **kwargs)

