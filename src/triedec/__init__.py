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
    "BeamOptions": "engine.beam", "Hypothesis": "engine.beam",
    "CostModel": "core.costmodel",
    "BaseDrafter": "drafters", "BaseSession": "drafters", "Drafter": "drafters", "DrafterSession": "drafters",
    "ModelInfo": "drafters", "Verified": "drafters", "register": "drafters",
    "Draft": "drafters.base",
    "custom_generate": "api.dropin",
    "Batch": "engine.batch", "BatchLimits": "engine.batch", "speculative_decode": "engine.batch",
    "TriedecError": "core.errors",
    "GenerationRequest": "api.generation",
    "Grammar": "core.grammar",
    "LM": "api.lm", "GenerationResult": "api.lm", "load": "api.loading",
    "Method": "engine.methods", "method": "engine.methods", "methods": "engine.methods",
    "Outcome": "engine.outcome", "Stats": "engine.outcome",
    "PrefixTrie": "core.prefixtrie",
    "Request": "engine.request", "StopRule": "engine.request",
    "Sampling": "core.sampling",
    "TokenTree": "core.tree",
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
    from triedec.api.dropin import custom_generate
    from triedec.api.generation import GenerationRequest
    from triedec.api.lm import LM, GenerationResult
    from triedec.api.loading import load
    from triedec.core.costmodel import CostModel
    from triedec.core.errors import TriedecError
    from triedec.core.grammar import Grammar
    from triedec.core.prefixtrie import PrefixTrie
    from triedec.core.sampling import Sampling
    from triedec.core.tree import TokenTree
    from triedec.drafters import BaseDrafter, BaseSession, Drafter, DrafterSession, ModelInfo, Verified, register
    from triedec.drafters.base import Draft
    from triedec.engine.batch import Batch, BatchLimits, speculative_decode
    from triedec.engine.beam import BeamOptions, Hypothesis
    from triedec.engine.methods import Method, method, methods
    from triedec.engine.outcome import Outcome, Stats
    from triedec.engine.request import Request, StopRule

__all__ = [
    "LM",
    "BaseDrafter",
    "BaseSession",
    "Batch",
    "BatchLimits",
    "BeamOptions",
    "CostModel",
    "Draft",
    "Drafter",
    "DrafterSession",
    "GenerationRequest",
    "GenerationResult",
    "Grammar",
    "Hypothesis",
    "Method",
    "ModelInfo",
    "Outcome",
    "PrefixTrie",
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
