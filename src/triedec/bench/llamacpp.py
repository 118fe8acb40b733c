"""The ``llamacpp`` baseline: what a CPU user would run instead of transformers.

llama.cpp (through ``llama-cpp-python``, the optional extra ``pip install 'triedec[llamacpp]'``)
runs the GGUF file itself, with its quantized weights and its own kernels, so its tokens are
not those of the fp32 model triedec decodes: they are never compared (``comparable = False``)
and its speed answers "is this faster than llama.cpp", not "is this exact". It decodes greedily
(or samples with the run's settings and seed, from llama.cpp's own sampler), from the same
prompt token ids, its EOS counted as one of its tokens (as triedec's and transformers' are) and
capped at the same ``max_new_tokens``, on as many threads as torch uses, with its KV cache
cleared before every run (llama-cpp-python otherwise reuses the previous run's matching prefix).

``llamacpp:lookup=N`` adds llama-cpp-python's own prompt-lookup decoding
(``LlamaPromptLookupDecoding(num_pred_tokens=N)`` as its draft model): the anchor a llama.cpp user
would reach for against triedec's drafters. Its tokens are not compared either (a trial on 12
prompts found them differing from llama.cpp's own plain decoding on 9).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from triedec.bench.runners import RunRecord
from triedec.core.errors import TriedecError
from triedec.core.sampling import GREEDY_SAMPLING, Sampling

LABEL = "llamacpp"
LOOKUP_CONTEXT = 2048
"""Positions a ``llamacpp:lookup=N`` runner starts with (grown as its runs need, up to the model's
context): its score buffer holds that many rows of logits."""


class LlamaCppRunner:
    """llama.cpp on ``gguf``; ``eos`` ends a run as it ends the others."""

    comparable = False

    def __init__(self, gguf: str | Path, label: str, eos: frozenset[int], context: int,
                 sampling: Sampling = GREEDY_SAMPLING, lookup: int = 0) -> None:
        if isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 0:
            raise TriedecError(f"lookup (prompt-lookup draft tokens) must be an integer >= 0, got {lookup!r}")
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as exc:
            raise TriedecError("the llamacpp baseline needs llama-cpp-python: pip install 'triedec[llamacpp]'") from exc
        path = Path(gguf)
        if path.suffix != ".gguf" or not path.is_file():
            raise TriedecError(f"the llamacpp baseline runs a .gguf file; {path} is not one (give the model as a "
                               ".gguf, or the entry llamacpp:gguf=PATH)")
        self.label, self.sampling, self.lookup, self.context, self.path = label, sampling, lookup, context, path
        self._llama_class, self._lookup_class = _counting(Llama), LlamaPromptLookupDecoding
        self.llm = self._llama(context if not lookup else min(context, LOOKUP_CONTEXT))
        self.eos = frozenset(eos) | {int(self.llm.token_eos())}

    def _llama(self, n_ctx: int) -> Any:
        """A llama.cpp model on :attr:`path` with a context of ``n_ctx`` positions (plus room for
        the drafts), counting its forwards (:func:`_counting`).

        With a draft model, llama-cpp-python (0.3.x) keeps every position's logits (it turns
        logits_all on itself) but sizes its score buffer from the logits_all argument: n_batch
        (512) rows, so a run past ~500 tokens failed inside its eval ("could not broadcast input
        array from shape (11 * vocab,) into shape (7 * vocab,)"). Asking for logits_all sizes the
        buffer to n_ctx rows, as its own eval needs (it computes nothing more than it did), but
        that buffer is n_ctx x vocab floats (32 GiB for Gemma 3's 32k context and 262k vocabulary),
        so a lookup runner's context is sized to the runs it gets (:meth:`run` grows it). The last
        token and its N drafts are evaluated at once, so n_ctx holds N + 1 more."""
        draft = {"draft_model": self._lookup_class(num_pred_tokens=self.lookup), "logits_all": True} \
            if self.lookup else {}
        self.n_ctx = n_ctx
        threads = torch.get_num_threads()
        return self._llama_class(model_path=str(self.path), n_ctx=n_ctx + (self.lookup + 1 if self.lookup else 0),
                                 n_threads=threads, n_threads_batch=threads, verbose=False, **draft)

    def reset(self) -> None:
        self.llm.reset()

    def run(self, prompt: list[int], max_new_tokens: int, seed: int | None = None) -> RunRecord:
        s = self.sampling
        needed = len(prompt) + max_new_tokens
        if needed > self.n_ctx and self.n_ctx < self.context:  # a lookup runner's context, grown (untimed)
            self.llm = self._llama(min(self.context, max(needed, 2 * self.n_ctx)))
        self.llm.reset()
        if not s.greedy:
            self.llm.set_seed(seed or 0)
        options = dict(top_k=1, top_p=1.0, min_p=0.0, temp=0.0) if s.greedy else \
            dict(top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, temp=s.temperature)
        tokens: list[int] = []
        self.llm.forwards = self.llm.evaluated = 0
        start = time.perf_counter()
        for token in self.llm.generate(prompt, repeat_penalty=s.repetition_penalty, reset=True, **options):
            tokens.append(int(token))  # an EOS counts, as it does in triedec's and transformers' outputs
            if token in self.eos or len(tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - start
        # the first eval is the prompt's; each later one a decoding step (the last token and its drafts)
        steps, computed = max(self.llm.forwards - 1, 0), max(self.llm.evaluated - len(prompt), 0)
        return RunRecord(tokens, seconds, steps, computed, 0)


def _counting(llama: Any) -> Any:
    """``llama`` (llama-cpp-python's ``Llama``) with a count of its forwards (``eval`` calls) and
    of the tokens they evaluated, so a run's steps and computed tokens are measured, drafts
    included, not assumed."""

    class CountingLlama(llama):  # type: ignore[misc, valid-type]
        forwards = evaluated = 0

        def eval(self, tokens: Any) -> None:
            self.forwards += 1
            self.evaluated += len(tokens)
            super().eval(tokens)

    return CountingLlama
