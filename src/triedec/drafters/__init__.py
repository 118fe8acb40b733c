"""Drafters: model-free proposers of draft trees, found through the registry.

Importing this package registers every built-in drafter.
"""

from triedec.drafters import auto, autoregressive, lookahead, ngram_trie, prompt_lookup, recycling
from triedec.drafters.base import BaseDrafter, BaseSession, Draft, Drafter, DrafterSession, ModelInfo, Verified
from triedec.drafters.registry import NEEDS_COST, MethodSpec, method_spec, method_specs, register

__all__ = [
    "NEEDS_COST",
    "BaseDrafter",
    "BaseSession",
    "Draft",
    "Drafter",
    "DrafterSession",
    "MethodSpec",
    "ModelInfo",
    "Verified",
    "auto",
    "autoregressive",
    "lookahead",
    "method_spec",
    "method_specs",
    "ngram_trie",
    "prompt_lookup",
    "recycling",
    "register",
]
