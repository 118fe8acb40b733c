"""lm-evaluation-harness against ``triedec serve``: the project's tasks (evals/lm_eval: a
multiple-choice task scored by loglikelihood, a short generation task), run through
``local-completions`` (token-id prompts from the server's own tokenizer routes, ``echo`` +
``logprobs``) and ``local-chat-completions``, against lm-eval's own ``hf`` model on the same
weights: the same accuracy, per-item loglikelihoods within float rounding, the same generations."""

from __future__ import annotations

import math
from pathlib import Path

import lm_eval
import pytest
from lm_eval.tasks import TaskManager

import triedec
from triedec.bench.load import serving
from triedec.server import ServerConfig, create_app

TASKS = Path(__file__).resolve().parents[1] / "evals" / "lm_eval"
MODEL = "tiny"


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """Nothing is looked up on a hub; datasets' cache in a temporary folder."""
    patch = pytest.MonkeyPatch()
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        patch.setenv(name, "1")
    patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
    yield
    patch.undo()


@pytest.fixture(scope="module")
def server(tiny_model_dir, offline):
    lm = triedec.load(tiny_model_dir)
    with serving(create_app(lm, ServerConfig(model_name=MODEL, method="auto"))) as url:
        yield url


def evaluate(model: str, model_args: dict, task: str, **kwargs) -> dict:
    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)  # the project's tasks only: fast
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                                   task_manager=tasks, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0, **kwargs)


def per_item(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_multiple_choice_through_local_completions_equals_the_hf_model(server, tiny_model_dir):
    ours = evaluate("local-completions", {"base_url": f"{server}/v1/completions", "model": MODEL,
                                          "tokenizer_backend": "remote", "max_retries": 1}, "triedec_mc")
    theirs = evaluate("hf", {"pretrained": str(tiny_model_dir), "dtype": "float32", "device": "cpu"}, "triedec_mc",
                      batch_size=1)
    assert ours["results"]["triedec_mc"]["acc,none"] == theirs["results"]["triedec_mc"]["acc,none"]
    assert ours["results"]["triedec_mc"]["acc_norm,none"] == theirs["results"]["triedec_mc"]["acc_norm,none"]
    got, want = per_item(ours, "triedec_mc"), per_item(theirs, "triedec_mc")
    assert len(got) == len(want) == 24
    for item_got, item_want in zip(got, want, strict=True):
        for (ll_got, greedy_got), (ll_want, greedy_want) in zip((r[0] for r in item_got), (r[0] for r in item_want),
                                                                strict=True):
            assert math.isclose(ll_got, ll_want, rel_tol=1e-5, abs_tol=1e-4), (ll_got, ll_want)
            assert greedy_got == greedy_want


def test_generation_through_local_chat_completions_equals_the_hf_model(server, tiny_model_dir):
    ours = evaluate("local-chat-completions", {"base_url": f"{server}/v1/chat/completions", "model": MODEL,
                                               "max_retries": 1}, "triedec_gen", apply_chat_template=True)
    theirs = evaluate("hf", {"pretrained": str(tiny_model_dir), "dtype": "float32", "device": "cpu"}, "triedec_gen",
                      batch_size=1, apply_chat_template=True)
    assert ours["results"]["triedec_gen"]["exact_match,number"] == \
        theirs["results"]["triedec_gen"]["exact_match,number"]
    assert per_item(ours, "triedec_gen") == per_item(theirs, "triedec_gen")
