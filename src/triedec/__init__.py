"""triedec: trie-shaped KV sharing for Hugging Face causal LMs.

>>> import triedec
>>> lm = triedec.load()                       # the embedded SmolLM2-135M-Instruct
>>> out = lm.generate("Hello", method="pld", max_new_tokens=32)
>>> out.text, out.stats.tokens_per_s
"""

from triedec.beam import BeamOptions, BeamResult, BeamStats, Hypothesis, beam_search
from triedec.drafters import Drafter, ModelInfo, Verified, method_spec, methods, register
from triedec.engine import DecodeStats, StopRule, speculative_decode
from triedec.errors import TriedecError
from triedec.lm import LM, GenerationResult, load
from triedec.tree import TokenTree

__version__ = "0.1.0"

__all__ = [
    "LM",
    "BeamOptions",
    "BeamResult",
    "BeamStats",
    "DecodeStats",
    "Drafter",
    "GenerationResult",
    "Hypothesis",
    "ModelInfo",
    "StopRule",
    "TokenTree",
    "TriedecError",
    "Verified",
    "__version__",
    "beam_search",
    "load",
    "method_spec",
    "methods",
    "register",
    "speculative_decode",
]
