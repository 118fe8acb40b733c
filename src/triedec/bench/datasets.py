"""Benchmark questions: Spec-Bench, HumanEval, MBPP (shipped in the package), ``repeated`` (a
workload asked twice, built from the first two), or a user's JSONL; and the JSON-extraction tasks
(:func:`extraction_tasks`, the structured-output benchmark's).

**Splits.** The shipped datasets are cut into two fixed halves by position within each category
(file order, counted from 0): the *tuning* split holds the even positions plus positions 7 and 41,
the *evaluation* split the other odd positions. Every default, threshold and calibration prompt of
triedec was chosen on tuning prompts (see :data:`TUNED_ON`); a published run samples the evaluation
split only, and warm-up runs use tuning prompts, so no timed prompt was ever seen before.
A user's JSONL file has no split: all of it is the sample.

Files are found in the installed package (``triedec/bench/data``); if that copy is missing, in
``../shared/data`` next to the current directory (the project's shared folder, a documented
fallback for source checkouts).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triedec.core.errors import TriedecError, positive_int

DATASETS = ("spec-bench", "humaneval", "mbpp", "repeated")
MT_BENCH = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
_FILES = {
    "spec-bench": "spec_bench_question.jsonl",
    "humaneval": "HumanEval.jsonl.gz",
    "mbpp": "mbpp/mbpp.jsonl",
}


@dataclass(frozen=True)
class Question:
    """One benchmark item: its user turns (a second turn is asked with the first answer in the
    history, as Spec-Bench does for MT-bench)."""

    id: str
    category: str
    turns: tuple[str, ...]


def data_path(name: str) -> Path:
    """Where a shipped data file lives: in the package, else ``../shared/data``."""
    packaged = Path(__file__).parent / "data" / name
    if packaged.is_file():
        return packaged
    shared = Path.cwd().parent / "shared" / "data" / name
    if shared.is_file():
        return shared
    raise TriedecError(f"data file {name} not found in the package ({packaged}) nor in {shared}")


SPLITS = ("evaluation", "tuning", "all")
EXTRA_TUNING_POSITIONS = frozenset({7, 41})
"""Odd positions that were tuned on before the split existed (``benchmarks/pld-tuning/tune.jsonl``),
and so belong to the tuning split."""
TUNED_ON = (
    "pld, ngram-trie and lookahead defaults: positions 7 and 41 of each Spec-Bench category "
    "(benchmarks/pld-tuning/tune.jsonl); auto's three revisions and every earlier published Spec-Bench "
    "table: positions 0, 16, 32, 48, 64; the repeated workload: positions 0 and 40; calibration prompts "
    "(recycling's profile, the cost curve): positions 8, 24, 40, 56, 72 -- all in the tuning split"
)
"""What was tuned on which prompts (recorded in every results file)."""


def in_tuning_split(position: int) -> bool:
    """Whether the question at ``position`` of its category (file order, from 0) is a tuning prompt."""
    return position % 2 == 0 or position in EXTRA_TUNING_POSITIONS


def split(questions: Sequence[Question], part: str) -> list[Question]:
    """The ``part`` (``evaluation``, ``tuning`` or ``all``) of a shipped dataset's questions, in
    file order (positions counted per category)."""
    if part not in SPLITS:
        raise TriedecError(f"--split must be one of {', '.join(SPLITS)}, got {part!r}")
    if part == "all":
        return list(questions)
    seen: dict[str, int] = {}
    out = []
    for q in questions:
        position = seen.get(q.category, 0)
        seen[q.category] = position + 1
        if in_tuning_split(position) == (part == "tuning"):
            out.append(q)
    return out


def _read_jsonl(path: Path) -> list[dict]:
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TriedecError(f"cannot read {path}: {exc}") from exc
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise TriedecError(f"{path} holds no JSON objects")
    return rows


def _spec_bench(rows: Iterable[dict]) -> list[Question]:
    out = []
    for r in rows:
        category = "mt_bench" if r["category"] in MT_BENCH else r["category"]
        out.append(Question(str(r["question_id"]), category, tuple(r["turns"])))
    return out


def _humaneval(rows: Iterable[dict]) -> list[Question]:
    return [
        Question(
            r["task_id"], "humaneval",
            (f"Complete the following Python function. Reply with the whole function in a Python code block."
             f"\n\n```python\n{r['prompt']}```",),
        )
        for r in rows
    ]


def _mbpp(rows: Iterable[dict]) -> list[Question]:
    return [
        Question(
            str(r["task_id"]), "mbpp",
            (f"You are an expert Python programmer, and here is your task: {r['text']} "
             f"Your code should pass these tests:\n\n" + "\n".join(r["test_list"]),),
        )
        for r in rows
        if 11 <= int(r["task_id"]) <= 510  # the test split
    ]


REPHRASINGS = (
    "I asked this before; please answer it again. ",
    "Here is the same request in other words. ",
    "One more time, please: ",
    "Could you help me with the following? ",
)
"""How the second pass of ``repeated`` rephrases a question's instruction (by question order)."""


def _repeated() -> list[Question]:
    """A workload that repeats itself, for methods with a memory across requests: pass 1 is
    Spec-Bench plus HumanEval (categories ``1:<category>``); pass 2 (``2:<category>``) asks the same
    Spec-Bench questions again with a rephrased instruction (the first turn prefixed with one of
    :data:`REPHRASINGS`) and the same HumanEval problems as similar functions (the function renamed
    and the instruction reworded). Every pass keeps the file order, so ``--per-category`` picks the
    same questions in both passes."""
    spec = _spec_bench(_read_jsonl(data_path(_FILES["spec-bench"])))
    code = _read_jsonl(data_path(_FILES["humaneval"]))
    first = [Question(q.id, f"1:{q.category}", q.turns) for q in spec]
    first += [Question(q.id, "1:humaneval", q.turns) for q in _humaneval(code)]
    second = [Question(f"{q.id}-again", f"2:{q.category}", (REPHRASINGS[i % len(REPHRASINGS)] + q.turns[0],
                                                            *q.turns[1:]))
              for i, q in enumerate(spec)]
    for r in code:
        name = r["entry_point"]
        prompt = r["prompt"].replace(name, f"{name}_v2")
        second.append(Question(f"{r['task_id']}-similar", "2:humaneval",
                               (f"Write this Python function; answer with the complete function in a Python code "
                                f"block.\n\n```python\n{prompt}```",)))
    return first + second


def _user_jsonl(rows: Sequence[dict], path: Path) -> list[Question]:
    out = []
    for i, r in enumerate(rows):
        if isinstance(r.get("turns"), list) and r["turns"] and all(isinstance(t, str) and t for t in r["turns"]):
            turns = tuple(r["turns"])
        elif isinstance(r.get("prompt"), str) and r["prompt"]:
            turns = (r["prompt"],)
        else:
            raise TriedecError(f"{path} line {i + 1}: needs a non-empty 'prompt' string or 'turns' list")
        out.append(Question(str(r.get("id", r.get("question_id", i))), str(r.get("category", "default")), turns))
    return out


def load_questions(dataset: str) -> list[Question]:
    """All questions of a named dataset or of a JSONL file path (fields ``prompt`` or ``turns``,
    optional ``id`` and ``category``)."""
    if dataset == "repeated":
        return _repeated()
    if dataset in _FILES:
        rows = _read_jsonl(data_path(_FILES[dataset]))
        return {"spec-bench": _spec_bench, "humaneval": _humaneval, "mbpp": _mbpp}[dataset](rows)
    path = Path(dataset)
    if path.suffix in (".jsonl", ".gz") or path.exists():
        if not path.is_file():
            raise TriedecError(f"dataset file not found: {path}")
        return _user_jsonl(_read_jsonl(path), path)
    raise TriedecError(f"unknown dataset {dataset!r}; use one of {', '.join(DATASETS)} or a path to a .jsonl file")


def select(
    questions: Sequence[Question], per_category: int | None = None, categories: Sequence[str] | None = None
) -> list[Question]:
    """A fixed sample: for each category (in order of first appearance), ``per_category``
    questions at evenly spaced positions in file order (index ``floor(i * n / k)``), so the same
    prompts are chosen on every run and machine and MT-bench's sub-categories are all covered."""
    by_cat: dict[str, list[Question]] = {}
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    if categories:
        unknown = sorted(set(categories) - set(by_cat))
        if unknown:
            raise TriedecError(f"unknown categories {unknown}; available: {', '.join(by_cat)}")
        by_cat = {c: by_cat[c] for c in by_cat if c in categories}
    if per_category is not None:
        positive_int("--per-category", per_category)
    out = []
    for items in by_cat.values():
        k = len(items) if per_category is None else min(per_category, len(items))
        out += [items[i * len(items) // k] for i in range(k)]
    return out


def warmup_questions(dataset: str, sample: Sequence[Question], count: int) -> list[Question]:
    """``count`` single-turn warm-up questions that share no turn with ``sample``: a shipped
    dataset's tuning split, one category after another; for a user's file, triedec's calibration
    prompts (themselves Spec-Bench tuning prompts)."""
    from triedec.api.calibration import calibration_prompts

    if count == 0:
        return []
    if dataset in DATASETS:
        by_cat: dict[str, list[Question]] = {}
        for q in split(load_questions(dataset), "tuning"):
            by_cat.setdefault(q.category, []).append(q)
        rounds = max((len(v) for v in by_cat.values()), default=0)
        pool = [Question(f"warmup-{q.id}", q.category, q.turns[:1])
                for i in range(rounds) for items in by_cat.values() if i < len(items) for q in items[i:i + 1]]
    else:
        prompts = calibration_prompts()
        pool = [Question(f"warmup-{i}", "warm-up", (p,)) for i, p in enumerate(dict.fromkeys(prompts))]
    used = {t for q in sample for t in q.turns}
    pool = [q for q in pool if q.turns[0] not in used]
    if len(pool) < count:
        raise TriedecError(f"only {len(pool)} warm-up prompts lie outside the sample; use --warmup {len(pool)} or less")
    return pool[:count]


def questions_sha256(questions: Sequence[Question]) -> str:
    """A hash of the questions' ids, categories and turns, in order (what a run was measured on)."""
    import hashlib

    data = json.dumps([[q.id, q.category, list(q.turns)] for q in questions], ensure_ascii=False)
    return hashlib.sha256(data.encode()).hexdigest()


EXTRACTION_FILE = "extraction.jsonl"
"""JSON-extraction tasks the project wrote (``scripts/json_bench.py``): 6 schemas (contact, invoice,
event, product, job, citation) x 6 texts to extract from; each schema's first task is the
*development* split (used while writing the benchmark), the other 30 the *evaluation* split."""


@dataclass(frozen=True)
class ExtractionTask:
    """One JSON-extraction task: its user prompt (the fields to extract and the text) and the
    JSON schema the answer must validate against."""

    id: str
    split: str
    prompt: str
    schema: dict[str, Any]


def extraction_tasks(part: str = "evaluation") -> list[ExtractionTask]:
    """The JSON-extraction tasks of one split (``evaluation``, ``development`` or ``all``), in file order."""
    if part not in ("evaluation", "development", "all"):
        raise TriedecError(f"unknown split {part!r}; use evaluation, development or all")
    rows = _read_jsonl(data_path(EXTRACTION_FILE))
    return [ExtractionTask(r["id"], r["split"], r["prompt"], r["schema"]) for r in rows
            if part == "all" or r["split"] == part]


PREFIX_WORKLOADS_FILE = "prefix_workloads.json"


def prefix_workloads() -> dict[str, Any]:
    """The prefix-trie benchmarks' workloads (``data/prefix_workloads.json``): ``conversations``
    (lists of user turns), ``passages`` (``id``, ``source``, ``text``) and the ``questions`` asked
    of each passage. Written for those benchmarks; never used to tune anything."""
    return json.loads(data_path(PREFIX_WORKLOADS_FILE).read_text())
