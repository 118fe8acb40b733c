"""Shared fixtures: the embedded default model and a saved tiny model directory. Helpers live in
``helpers.py``.

The suite runs in two pytest-xdist workers (``make test``: ``-n 2``), each on one of the machine's
two cores: torch gets one thread per worker (two when run without xdist), ``TRIEDEC_THREADS`` says
the same to the CLI and every ``triedec`` process a test starts (so they share the worker's
calibration, measured with a core to itself), and a test that changes the count has it put back
when it ends. Calibrations measured on first use take the quick effort (``TRIEDEC_CALIBRATION``):
what a calibration measures only sizes drafts, never which tokens come out, and the workers share
one cache directory, so each calibration is measured once (under its lock)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import save_tiny_model

THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
"""torch's CPU threads in this test process."""

torch.set_num_threads(THREADS)
os.environ["TRIEDEC_THREADS"] = str(THREADS)
os.environ["TRIEDEC_CALIBRATION"] = "quick"


@pytest.fixture(autouse=True)
def _threads():
    """Every test starts with :data:`THREADS` threads, whatever the one before it set."""
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the default model is marked ``default_model`` (the fast lane skips
    them), whether or not its module remembered to say so."""
    for item in items:
        if {"default_lm", "default_mode_lm"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.default_model)


@pytest.fixture(scope="session")
def default_lm():
    import triedec

    return triedec.load(weights="float")  # float32: the tests compare with stock transformers


@pytest.fixture(scope="session")
def default_mode_lm():
    """The default model in the mode ``triedec.load()`` gives it (``weights="auto"``: int4-a8 on a
    CPU with the vector kernels, else float32), for tests that compare every method with ``ar`` in
    one mode: what a user gets, and ~5x faster a step than float32."""
    import triedec

    return triedec.load()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny random Llama with a tiny BPE tokenizer and a chat template."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    """The tiny model, loaded once per module: a module's learned state and built methods stay
    its own."""
    import triedec

    return triedec.load(tiny_model_dir)


@pytest.fixture(scope="module")
def base(lm, request):
    """A server for the module's ``lm`` on loopback, answering as ``"tiny"`` with the module's
    ``SERVER_METHOD`` (``"auto"`` when it names none) as its default method; its base URL."""
    from triedec.bench.load import serving
    from triedec.server import ServerConfig, create_app

    method = getattr(request.module, "SERVER_METHOD", "auto")
    with serving(create_app(lm, ServerConfig(model_name="tiny", method=method))) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    """The ``openai`` client for :func:`base` (no retries, so a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
