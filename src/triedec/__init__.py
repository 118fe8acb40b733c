"""triedec: trie-shaped KV sharing for Hugging Face causal LMs.

>>> import triedec
>>> lm = triedec.load()                       # the embedded SmolLM2-135M-Instruct
>>> out = lm.generate("Hello", method="pld", max_new_tokens=32)
>>> out.text, out.stats.tokens_per_s
>>> outs = lm.generate_batch(["Hi", "Bonjour"], max_new_tokens=32)   # decoded together
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "BeamOptions": "beam", "BeamStats": "beam", "Hypothesis": "beam",
    "CostModel": "costmodel",
    "BaseDrafter": "drafters", "BaseSession": "drafters", "Drafter": "drafters", "DrafterSession": "drafters",
    "ModelInfo": "drafters", "Verified": "drafters", "register": "drafters",
    "Draft": "drafters.base",
    "custom_generate": "dropin",
    "Batch": "engine", "BatchLimits": "engine", "speculative_decode": "engine",
    "TriedecError": "errors",
    "GenerationRequest": "generation",
    "LM": "lm", "GenerationResult": "lm", "load": "loading",
    "Method": "methods", "method": "methods", "methods": "methods",
    "DecodeStats": "outcome", "Outcome": "outcome", "Stats": "outcome", "Request": "request", "StopRule": "request",
    "Sampling": "sampling",
    "TokenTree": "tree",
}
"""Each public name and the module it lives in. They load on first use (PEP 562), so ``import
triedec`` and ``triedec --help`` do not import torch and transformers."""


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'triedec' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"triedec.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from triedec.beam import BeamOptions, BeamStats, Hypothesis
    from triedec.costmodel import CostModel
    from triedec.drafters import BaseDrafter, BaseSession, Drafter, DrafterSession, ModelInfo, Verified, register
    from triedec.drafters.base import Draft
    from triedec.dropin import custom_generate
    from triedec.engine import Batch, BatchLimits, speculative_decode
    from triedec.errors import TriedecError
    from triedec.generation import GenerationRequest
    from triedec.lm import LM, GenerationResult
    from triedec.loading import load
    from triedec.methods import Method, method, methods
    from triedec.outcome import DecodeStats, Outcome, Stats
    from triedec.request import Request, StopRule
    from triedec.sampling import Sampling
    from triedec.tree import TokenTree

__all__ = [
    "LM",
    "BaseDrafter",
    "BaseSession",
    "Batch",
    "BatchLimits",
    "BeamOptions",
    "BeamStats",
    "CostModel",
    "DecodeStats",
    "Draft",
    "Drafter",
    "DrafterSession",
    "GenerationRequest",
    "GenerationResult",
    "Hypothesis",
    "Method",
    "ModelInfo",
    "Outcome",
    "Request",
    "Sampling",
    "Stats",
    "StopRule",
    "TokenTree",
    "TriedecError",
    "Verified",
    "__version__",
    "custom_generate",
    "load",
    "method",
    "methods",
    "register",
    "speculative_decode",
]
