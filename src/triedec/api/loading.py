"""Loading a model: :func:`load` (what ``triedec.load`` is) and :func:`load_source`, which turn a
model's name or file into an :class:`~triedec.api.lm.LM`."""

from __future__ import annotations

import os

import torch

from triedec.api.lm import LM
from triedec.core.errors import TriedecError
from triedec.core.params import DEFAULT_WEIGHTS
from triedec.model.adapter import KERNELS
from triedec.model.source import ModelSource


def load(
    model: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    weights: str = DEFAULT_WEIGHTS,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
    kernels: str = "auto",
) -> LM:
    """Load a causal LM: a local HF directory, a cached hub id, a ``.gguf`` file, or (``None``)
    the embedded default SmolLM2-135M-Instruct. The arguments other than ``kernels`` are
    :class:`~triedec.model.source.ModelSource`'s (see :mod:`triedec.model.source`).

    ``dtype`` and ``weights`` choose the precision mode (:mod:`triedec.model.precision`):
    ``weights="auto"`` (default) loads a GGUF file stored in 4 bits in ``int4-a8`` (its own codes,
    bfloat16 activations) on a CPU with AVX2 or AVX512-VNNI, and anything else in ``float``
    (:data:`~triedec.core.params.AUTO_WEIGHTS`); ``weights="float"`` with ``dtype`` float32 (its
    default), ``"bfloat16"`` or ``"float16"``; ``"int8"``, ``"int4"`` or ``"int4-a8"`` (bfloat16
    activations, CPU).
    Every method returns the tokens ``ar`` returns in the same mode. The stock copy the benchmark
    and tests compare against (:meth:`LM.reference_model`) is loaded in the same mode.

    ``kernels="auto"`` (default) runs the loaded model on faster kernels where they apply (oneDNN
    pre-packed linears on CPU: fp32, and bf16 where oneDNN has bf16 kernels; triedec's fixed-order
    tree attention on CPU; :mod:`triedec.model.adapter`); ``"plain"`` keeps stock transformers.
    ``lm.adapter.kernels`` says which ran."""
    return load_source(ModelSource(model, dtype, weights, device, attn_implementation, cache_dir), kernels)


def load_source(source: ModelSource, kernels: str = "auto") -> LM:
    """:func:`load` for a :class:`~triedec.model.source.ModelSource` value."""
    if kernels not in KERNELS:
        raise TriedecError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    hf_model, tokenizer = source.load_hf()
    return LM(hf_model, tokenizer, cache_dir=source.cache_dir, kernels=kernels,
              reference=lambda: source.load_hf()[0])
