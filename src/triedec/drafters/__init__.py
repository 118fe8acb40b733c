"""Drafters: model-free proposers of draft trees, found through the registry.

Importing this package registers every built-in method.
"""

from triedec.drafters import autoregressive, prompt_lookup, recycling
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
    "method_spec",
    "methods",
    "prompt_lookup",
    "recycling",
    "register",
]
