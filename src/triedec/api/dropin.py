"""A drop-in for transformers' ``generate``: ``model.generate(input_ids,
custom_generate=triedec.custom_generate, method="pld", max_new_tokens=64)``.

transformers prepares everything as usual (generation config, special tokens, lengths, logits
processors, stopping criteria, the streamer's prompt) and then calls :func:`custom_generate`
instead of its own decoding loop. triedec decodes the single sequence with ``method`` and returns
what ``generate`` returns: the tensor ``[1, prompt + new tokens]``, or a
``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate=True`` (``sequences`` only). The
tokens are greedy ``generate``'s (or, with ``do_sample=True``, a sample from the same distribution
drawn with a seed taken from torch's RNG, so ``torch.manual_seed`` makes it reproducible).

Honoured: ``max_new_tokens`` / ``max_length``, ``eos_token_id``, a streamer, ``do_sample`` with
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``. Refused with a clear error:
a batch of more than one sequence, padding, and any other logits processor or stopping criterion
(``stop_strings``, ``min_new_tokens``, ``no_repeat_ngram_size``, ...), so nothing is silently
ignored. Each call builds its method anew: drafters' learned state does not persist across calls
(use :class:`triedec.LM` for that); the device calibration is read from its cache.

**The streamer.** transformers (checked on 5.23) hands a callable ``custom_generate`` only the
parameters ``_sample`` lacks: it puts the prompt into ``generate(streamer=...)`` and then drops
the streamer (and ``tokenizer``). Pass the streamer as ``triedec_streamer=`` instead: it receives
the prompt, then the new tokens as they are accepted, then ``end()``, as ``streamer=`` would. A
``streamer`` that does arrive (a transformers that forwards it) is fed the new tokens too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from triedec.api.generation import GenerationRequest
from triedec.api.lm import LM
from triedec.core.errors import TriedecError
from triedec.core.params import DEFAULT_METHOD
from triedec.core.sampling import Sampling

_PROCESSORS = (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
               MinPLogitsWarper)
_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)


def custom_generate(
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    synced_gpus: bool = False,
    streamer: Any = None,
    method: str = DEFAULT_METHOD,
    method_options: Mapping[str, object] | None = None,
    triedec_streamer: Any = None,
    **model_kwargs: Any,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """Called by ``model.generate(..., custom_generate=triedec.custom_generate)`` after its own
    preparation; ``method`` and ``method_options`` (``generate`` keyword arguments) pick triedec's
    method, ``triedec_streamer`` receives the tokens (see the module doc for why not ``streamer``).
    Methods that calibrate on text (recycling's device-sized tree) are refused: transformers does
    not hand over a tokenizer, so use options that need none (``nodes=80``) or :class:`triedec.LM`."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise TriedecError(f"triedec.custom_generate decodes one sequence; got a batch of {input_ids.shape[0]} "
                           "(call generate once per prompt, or use triedec serve for many requests)")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise TriedecError("triedec.custom_generate does not take padded input (attention_mask has zeros)")
    if synced_gpus:
        raise TriedecError("triedec.custom_generate does not support synced_gpus")
    _check_supported(logits_processor, "logits processor", _PROCESSORS)
    _check_supported(stopping_criteria, "stopping criterion", _CRITERIA)
    prompt = input_ids[0].tolist()
    max_new = int(generation_config.max_length) - len(prompt)
    if max_new < 1:
        raise TriedecError(f"max_length {generation_config.max_length} leaves no room after the "
                           f"{len(prompt)}-token prompt")
    eos = generation_config.eos_token_id
    lm = LM(model, _NoTokenizer(), kernels="plain")
    lm.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else [int(e) for e in eos])
    steps = lm.stream(GenerationRequest(prompt, method, dict(method_options or {}), max_new,
                                        sampling=_sampling(generation_config)))
    streamers = [s for s in (streamer, triedec_streamer) if s is not None]
    if triedec_streamer is not None:
        triedec_streamer.put(input_ids.cpu())  # what generate does for streamer=
    new: list[int] = []
    for tokens in steps:
        new += tokens
        for s in streamers:
            s.put(torch.tensor(tokens, dtype=torch.long))
    for s in streamers:
        s.end()
    sequences = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _check_supported(items: Any, what: str, allowed: tuple[type, ...]) -> None:
    other = sorted({type(p).__name__ for p in items or () if not isinstance(p, allowed)})
    if other:
        raise TriedecError(f"triedec.custom_generate does not support the {what}(s) {other}; it honours "
                           "max_new_tokens, eos_token_id, do_sample, temperature, top_k, top_p, min_p and "
                           "repetition_penalty")


def _sampling(config: Any) -> Sampling:
    """The sampling of a prepared generation config (greedy unless ``do_sample``; a parameter the
    config leaves unset is off, as in transformers); the seed comes from torch's RNG."""
    given: dict[str, Any] = {}
    if config.repetition_penalty is not None:
        given["repetition_penalty"] = float(config.repetition_penalty)
    if not config.do_sample:
        return Sampling(**given)
    given["temperature"] = float(config.temperature if config.temperature is not None else 1.0)
    given |= {name: kind(getattr(config, name)) for name, kind in (("top_k", int), ("top_p", float), ("min_p", float))
              if getattr(config, name) is not None}
    return Sampling(**given, seed=int(torch.randint(0, 2**63 - 1, (1,))))


class _NoTokenizer:
    """transformers hands a custom generate no tokenizer: token ids only."""

    eos_token_id = None
    chat_template = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TriedecError("this method calibrates on text, and transformers hands custom_generate no tokenizer: "
                           "use options that need no calibration (e.g. recycling nodes=80) or triedec.LM")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise TriedecError("triedec.custom_generate works on token ids only")
