"""triedec: trie-shaped KV sharing for Hugging Face causal LMs.

>>> import triedec
>>> lm = triedec.load()                       # the embedded SmolLM2-135M-Instruct
>>> out = lm.generate("Hello", method="pld", max_new_tokens=32)
>>> out.text, out.stats.tokens_per_s
>>> outs = lm.generate_batch(["Hi", "Bonjour"], max_new_tokens=32)   # decoded together
"""

from triedec.beam import BeamOptions, BeamStats, Hypothesis
from triedec.costmodel import CostModel
from triedec.drafters import BaseDrafter, BaseSession, Drafter, DrafterSession, ModelInfo, Verified, register
from triedec.drafters.base import Draft
from triedec.dropin import custom_generate
from triedec.engine import Batch, BatchLimits, speculative_decode
from triedec.errors import TriedecError
from triedec.lm import LM, GenerationResult, load
from triedec.methods import Method, method, methods
from triedec.request import DecodeStats, Outcome, Request, Stats, StopRule
from triedec.sampling import Sampling
from triedec.tree import TokenTree

__version__ = "0.1.0"

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
