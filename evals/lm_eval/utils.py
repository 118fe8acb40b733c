"""Loads the tasks' rows from the jsonl files beside this file (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).parent


def _rows(name: str) -> list[dict[str, Any]]:
    with open(HERE / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def multiple_choice(**_: Any) -> dict[str, datasets.Dataset]:
    return {"test": datasets.Dataset.from_list(_rows("triedec_mc.jsonl"))}


def generation(**_: Any) -> dict[str, datasets.Dataset]:
    return {"test": datasets.Dataset.from_list(_rows("triedec_gen.jsonl"))}


def multiple_choice_long(**_: Any) -> dict[str, datasets.Dataset]:
    return {"test": datasets.Dataset.from_list(_rows("triedec_mc_long.jsonl"))}
