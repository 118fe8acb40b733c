"""Shared fixtures: the embedded default model and a saved tiny model directory. Helpers live in
``helpers.py``."""

from __future__ import annotations

import pytest
import torch
from helpers import save_tiny_model

torch.set_num_threads(2)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the default model is marked ``default_model`` (the fast lane skips
    them), whether or not its module remembered to say so."""
    for item in items:
        if "default_lm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.default_model)


@pytest.fixture(scope="session")
def default_lm():
    import triedec

    return triedec.load()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny random Llama with a tiny BPE tokenizer and a chat template."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
