"""Beam search's pure parts: :class:`BeamOptions` (transformers' settings and defaults),
:class:`Hypothesis` (a returned sequence) and :class:`BeamScorer`, a line-by-line port of
``transformers``' beam search bookkeeping (``GenerationMixin._beam_search``, transformers 5.x) for
one prompt: log-probs in, chosen parents and tokens out. :mod:`triedec.engine.beam` drives it with model
forwards over a trie-shaped KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from triedec.core.errors import TriedecError, positive_int
from triedec.core.settings import at_most

DEFAULT_GC_EVERY = 5
"""Compaction period in steps, chosen by measurement (benchmarks/beam-gc: every 1 or 5 steps was as
fast as or faster than the paper's 15 and held less KV)."""
_NEG = -1.0e9  # transformers' "impossible" score


@dataclass(frozen=True)
class BeamOptions:
    """Beam search settings, with ``transformers``' meaning and defaults."""

    num_beams: int = field(default=4, metadata=at_most(64))
    """beams kept alive per step (b): one step verifies b tokens, and the trie KV holds up to
    prompt + b x max_new_tokens slots (:func:`kv_slots`)"""
    length_penalty: float = 1.0
    """finished score = sum of log-probs / generated length ** length_penalty"""
    early_stopping: bool | str = False
    """True: stop when num_beams hypotheses are finished; False: stop when no live beam can do
    better (heuristic); "never": the canonical test"""
    num_return_sequences: int = 1
    """best finished hypotheses returned (<= num_beams)"""
    gc_every: int = field(default=DEFAULT_GC_EVERY, metadata=at_most(64))
    """compact the trie KV every N steps (0 = only when the buffers are full)"""

    CLI_ALIASES: ClassVar[dict[str, str]] = {
        "num_beams": "--num-beams", "length_penalty": "--length-penalty", "early_stopping": "--early-stopping",
        "num_return_sequences": "--num-return-sequences", "gc_every": "--gc-every"}
    """short command-line flags (transformers' names) besides ``--beam-OPTION``"""

    def __post_init__(self) -> None:
        positive_int("num_beams", self.num_beams)
        positive_int("num_return_sequences", self.num_return_sequences)
        if self.num_return_sequences > self.num_beams:
            raise TriedecError(
                f"num_return_sequences ({self.num_return_sequences}) cannot exceed num_beams ({self.num_beams})"
            )
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp):
            raise TriedecError(f"length_penalty must be a finite number, got {lp!r}")
        object.__setattr__(self, "length_penalty", float(lp))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise TriedecError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        gc = self.gc_every
        if isinstance(gc, bool) or not isinstance(gc, int) or gc < 0:
            raise TriedecError(f"gc_every must be an integer >= 0, got {gc!r}")


@dataclass(frozen=True)
class Hypothesis:
    """A returned sequence: its new tokens (ending with the EOS token if it ended on one) and its
    score (sum of token log-probs / length ** length_penalty, as in transformers)."""

    token_ids: tuple[int, ...]
    score: float


class BeamScorer:
    """transformers' beam search state for one prompt, as tensors of a batch of one.

    Per step, :meth:`step` takes the running beams' next-token log-probs ``[b, vocab]`` and returns
    which beam each new running beam extends (``parents [b]``) and with which token (``tokens
    [b]``). It mirrors ``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
    ``_update_finished_beams``, ``_check_early_stop_heuristic`` and
    ``_beam_search_has_unfinished_sequences`` operation for operation, so that float ties and the
    -1e9 sentinels behave identically. Mutates only itself.
    """

    def __init__(self, options: BeamOptions, prompt_len: int, max_new_tokens: int, eos_token_ids: frozenset[int]):
        b = options.num_beams
        self.options = options
        self.prompt_len = prompt_len
        self.max_length = prompt_len + max_new_tokens
        self.cur_len = prompt_len
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
        self.keep = max(2, 1 + len(eos_token_ids)) * b
        self.top_mask = torch.cat((torch.ones(b, dtype=torch.bool), torch.zeros(self.keep - b, dtype=torch.bool)))
        self.running_scores = torch.zeros((1, b))
        self.running_scores[:, 1:] = _NEG
        self.running: list[tuple[int, ...]] = [() for _ in range(b)]
        self.finished: list[tuple[int, ...]] = [() for _ in range(b)]
        self.finished_scores = torch.full((1, b), _NEG)
        self.is_finished = torch.zeros((1, b), dtype=torch.bool)
        self.unsatisfied = torch.ones((1, 1), dtype=torch.bool)
        self.done = False

    def step(self, log_probs: torch.Tensor) -> tuple[list[int], list[int]]:
        """Advance one token. ``log_probs [b, vocab]`` (float32) of the running beams, in order."""
        if self.done:
            raise TriedecError("beam search is already finished")
        b, opts = self.options.num_beams, self.options
        vocab = log_probs.shape[-1]
        scores = (log_probs[None] + self.running_scores[:, :, None]).reshape(1, -1)  # [1, b * vocab]
        # top-K continuations
        topk_scores, topk_index = torch.topk(scores, k=self.keep)
        topk_beam = (topk_index // vocab)[0].tolist()
        topk_tokens = (topk_index % vocab)[0]
        token_list = topk_tokens.tolist()
        candidates = [(*self.running[beam], tok) for beam, tok in zip(topk_beam, token_list, strict=True)]
        hits = torch.isin(topk_tokens, self.eos) | (self.cur_len + 1 >= self.max_length)
        hits = hits[None]  # [1, keep]
        # running beams for the next step
        running_scores = topk_scores + hits.to(torch.float32) * _NEG
        nxt = torch.topk(running_scores, k=b)[1]
        self.running_scores = torch.take_along_dim(running_scores, nxt, dim=1)
        nxt_list = nxt[0].tolist()
        self.running = [candidates[i] for i in nxt_list]
        parents = [topk_beam[i] for i in nxt_list]
        tokens = [token_list[i] for i in nxt_list]
        # finished hypotheses
        just_finished = hits & self.top_mask[None, :]
        fin = topk_scores / ((self.cur_len + 1 - self.prompt_len) ** opts.length_penalty)
        full = torch.all(self.is_finished, dim=-1, keepdim=True) & (opts.early_stopping is True)
        fin = fin + full.to(torch.float32) * _NEG
        fin = fin + (~self.unsatisfied).to(torch.float32) * _NEG
        fin = fin + (~just_finished) * _NEG
        merged_scores = torch.cat((self.finished_scores, fin), dim=1)
        merged = [*self.finished, *candidates]
        merged_finished = torch.cat((self.is_finished, just_finished), dim=1)
        best = torch.topk(merged_scores, k=b)[1]
        self.finished = [merged[i] for i in best[0].tolist()]
        self.finished_scores = torch.take_along_dim(merged_scores, best, dim=1)
        self.is_finished = torch.take_along_dim(merged_finished, best, dim=1)
        # stopping
        self.cur_len += 1
        self._update_early_stop_heuristic()
        improvement_possible = bool(self.unsatisfied.any())
        exists_open_beam = not (bool(self.is_finished.all()) and opts.early_stopping is True)
        valid_continuations = not bool(hits.all())
        self.done = not (improvement_possible and exists_open_beam and valid_continuations)
        return parents, tokens

    def _update_early_stop_heuristic(self) -> None:
        opts = self.options
        if opts.early_stopping == "never" and opts.length_penalty > 0.0:
            best_length = self.max_length - self.prompt_len
        else:
            best_length = self.cur_len - self.prompt_len
        best_running = self.running_scores[:, :1] / (best_length**opts.length_penalty)
        worst_finished = torch.where(
            self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], torch.tensor(_NEG)
        )
        self.unsatisfied = self.unsatisfied & torch.any(best_running > worst_finished, dim=-1, keepdim=True)

    def stable_prefix(self) -> tuple[int, ...]:
        """Tokens every possible final answer starts with: the common prefix of the running beams
        and the finished hypotheses still held (later results descend from one of them)."""
        held = [*self.running, *(h for h, f in zip(self.finished, self.is_finished[0].tolist(), strict=True) if f)]
        prefix: list[int] = []
        for column in zip(*held, strict=False):
            if any(t != column[0] for t in column):
                break
            prefix.append(column[0])
        return tuple(prefix)

    def results(self) -> list[Hypothesis]:
        """The ``num_return_sequences`` best finished hypotheses, best first."""
        n = self.options.num_return_sequences
        scores = self.finished_scores[0, :n].tolist()
        return [Hypothesis(tokens, score) for tokens, score in zip(self.finished[:n], scores, strict=True)]
