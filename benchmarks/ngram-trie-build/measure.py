"""N-Gram Trie build cost for a 4k-token context, next to the prefill of the same context.

Context: Spec-Bench rag and summarization prompts concatenated and cut to 4,096 tokens (default
tokenizer). Build = ``NgramTrie(13, 3).add(tokens)`` (median of 5); prefill = one forward of the
4,096 tokens through the default model (median of 3). Run from the repository root:

    python benchmarks/ngram-trie-build/measure.py > benchmarks/ngram-trie-build/results.json
"""

from __future__ import annotations

import json
import statistics
import time
import tracemalloc

import torch

import triedec
from triedec.bench.datasets import load_questions
from triedec.drafters.ngram_trie import NgramTrie

CONTEXT = 4096


def main() -> None:
    torch.set_num_threads(2)
    lm = triedec.load()
    text = "\n\n".join(q.turns[0] for q in load_questions("spec-bench") if q.category in ("rag", "summarization"))
    tokens = lm.tokenizer(text, add_special_tokens=False)["input_ids"][:CONTEXT]
    builds = []
    for _ in range(5):
        start = time.perf_counter()
        trie = NgramTrie(13, 3)
        trie.add(tokens)
        builds.append(time.perf_counter() - start)
    tracemalloc.start()
    trie = NgramTrie(13, 3)
    trie.add(tokens)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    prefills = []
    for _ in range(3):
        cache = lm.adapter.new_cache(len(tokens))
        start = time.perf_counter()
        lm.adapter.prefill(cache, torch.tensor(tokens))
        prefills.append(time.perf_counter() - start)
    print(json.dumps({
        "context_tokens": len(tokens), "n": 13, "prefix": 3, "trie_nodes": trie.size,
        "build_ms_median": round(1000 * statistics.median(builds), 1),
        "build_peak_python_mb": round(peak / 2**20, 1),
        "prefill_ms_median": round(1000 * statistics.median(prefills), 1),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }, indent=1))


if __name__ == "__main__":
    main()
