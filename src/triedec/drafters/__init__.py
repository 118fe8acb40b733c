"""Drafters: model-free proposers of draft trees, found through the registry.

Importing this package registers every built-in method.
"""

from triedec.drafters import autoregressive, lookahead, ngram_trie, prompt_lookup, recycling
from triedec.drafters.base import (
    BaseDrafter,
    Drafter,
    MethodSpec,
    ModelInfo,
    Verified,
    method_spec,
    methods,
    register,
)

__all__ = [
    "BaseDrafter",
    "Drafter",
    "MethodSpec",
    "ModelInfo",
    "Verified",
    "autoregressive",
    "lookahead",
    "method_spec",
    "methods",
    "ngram_trie",
    "prompt_lookup",
    "recycling",
    "register",
]
