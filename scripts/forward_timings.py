"""What one forward costs in each of triedec's runners, in one process on the same weights:
transformers' forward (``transformers``), triedec's runner walking the layers in Python (``walk``)
and, where it applies, the same runner's forward in one native call (``native``;
``model/runner.py``, ``csrc/decoder.cpp``). Forwards, not decoding: no sampling, no drafting.

Four shapes, each on a cache already holding ``--context`` tokens: one token (plain decoding's
step), a 16-token verify tree (the root and 4 chains of 3 and 4 drafts under it), a
``--prompt``-token prompt chunk with every row's logits, and the same chunk with only its last
row's (as prefill runs it, and as ``llama-bench``'s ``pp`` test does). Each runner's forwards of
a shape run in rounds, the runners in a shuffled order per round; the median and the quartiles
are over the rounds' own medians. Also checks that the runners' logits are ``torch.equal`` on
each shape, and says if not; and prints the bytes a token reads for the weights as held against
the GGUF file's own bytes for the same layers.

    .venv/bin/python scripts/forward_timings.py --weights int4-a8 --out benchmarks/native-forward-cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import triedec
from triedec.bench.report import machine_info, source_commit, versions
from triedec.core.tree import TokenTree
from triedec.model.adapter import ForwardItem, ModelAdapter
from triedec.model.native import load_kernel, switchable_libraries
from triedec.model.precision import linear_weight_bytes
from triedec.model.runner import RUNNER, TRANSFORMERS
from triedec.model.source import default_model_path, gguf_linear_bytes


def draft_tree(size: int, root: int, gen: torch.Generator) -> TokenTree:
    """A verify tree of ``size`` nodes as a step carries one: the root (the last committed token)
    and 4 chains under it."""
    tokens = [root, *torch.randint(100, 4000, (size - 1,), generator=gen).tolist()]
    return TokenTree(tuple(tokens), tuple(-1 if i == 0 else 0 if i <= 4 else i - 4 for i in range(size)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--weights", default="int4-a8")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=15, help="forwards of the one-token shape per round")
    parser.add_argument("--isa", default=None,
                        help="run this installed kernel build (avx512amx, avx512vnni, avxvnni, avxvnni_evex, avx2, "
                             "portable) instead of the fastest this CPU runs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.isa is not None:
        libraries = switchable_libraries()
        if args.isa not in libraries:
            parser.error(f"--isa {args.isa}: the installed builds this CPU runs are {sorted(libraries)}")
        load_kernel().use_kernels(str(libraries[args.isa]))
    lm = triedec.load(args.model, weights=args.weights, dtype=args.dtype)
    runners: dict[str, ModelAdapter] = {"native": lm.adapter} if lm.adapter.native_forward else {}
    walk = ModelAdapter(triedec.load(args.model, weights=args.weights, dtype=args.dtype, kernels="plain").model,
                        "auto", runner=RUNNER)
    if walk._runner is not None:
        walk._runner._native = None  # the same runner, its layers walked in Python
        walk.native_forward = False
        runners["walk"] = walk
    runners["transformers"] = ModelAdapter(
        triedec.load(args.model, weights=args.weights, dtype=args.dtype, kernels="plain").model, "auto",
        runner=TRANSFORMERS)
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, lm.adapter.vocab_size - 100, (args.context,), generator=gen)
    caches = {}
    for name, adapter in runners.items():
        cache = adapter.new_cache(args.context + args.prompt + 32)
        adapter.prefill(cache, context)
        cache.commit(list(range(args.context)))
        caches[name] = cache
    tree = draft_tree(16, int(context[-1]), gen)
    shapes = {
        "one token": (torch.tensor([1234]), torch.tensor([args.context]), torch.ones((1, 1), dtype=torch.bool), -1),
        "16-token tree": (torch.tensor(tree.tokens), tree.positions(args.context)[0], tree.ancestry, -1),
        f"{args.prompt}-token prompt chunk": (torch.randint(100, 4000, (args.prompt,), generator=gen),
                                               torch.arange(args.context, args.context + args.prompt),
                                               torch.ones((args.prompt, args.prompt), dtype=torch.bool).tril(), -1),
    }
    # prefill as it runs: the same chunk, only its last row's logits (the head on one row)
    chunk = shapes[f"{args.prompt}-token prompt chunk"]
    shapes[f"{args.prompt}-token prompt chunk, last row's logits"] = (*chunk[:3], 1)

    def forward(name: str, shape: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
        tokens, positions, visible, keep = shape
        out = runners[name].forward_batch([ForwardItem(caches[name], tokens, positions, visible, keep)])[0]
        caches[name].commit([])
        return out

    order = random.Random(0)
    results: dict[str, dict[str, dict[str, float]]] = {}
    equal: dict[str, bool] = {}
    for label, shape in shapes.items():
        outs = [forward(name, shape) for name in runners]
        equal[label] = all(torch.equal(outs[0], o) for o in outs[1:])
        per_round = max(1, args.per_round * 16 // max(16, shape[0].numel()))
        medians: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.rounds):
            names = list(runners)
            order.shuffle(names)
            for name in names:
                forward(name, shape)  # warm
                times = []
                for _ in range(per_round):
                    start = time.perf_counter()
                    forward(name, shape)
                    times.append(time.perf_counter() - start)
                medians[name].append(1e3 * statistics.median(times))
        results[label] = {}
        for name, values in medians.items():
            q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
            results[label][name] = {"median_ms": statistics.median(values), "q1_ms": q[0], "q3_ms": q[2]}
    held = linear_weight_bytes(lm.model)
    path = Path(args.model) if args.model is not None else default_model_path()
    in_file = gguf_linear_bytes(path) if path.suffix == ".gguf" else None
    weights = (f"weights a token reads (the linears and the head as held): {held / 1e6:.1f} MB"
               + ("" if in_file is None else f", the file's {in_file / 1e6:.1f} MB ({held / in_file:.2f}x)"))
    lines = [f"{lm.adapter.precision.name} ({lm.adapter.kernels}; kernel build {load_kernel().isa()}), "
             f"{args.threads} threads, "
             f"{args.context}-token cache; median ms [quartiles] over {args.rounds} rounds; {weights}", ""]
    lines.append("| shape | " + " | ".join(runners) + " | logits equal |")
    lines.append("|---|" + "---|" * (len(runners) + 1))
    for label, row in results.items():
        cells = [f"{r['median_ms']:.2f} [{r['q1_ms']:.2f}, {r['q3_ms']:.2f}]" for r in row.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {'yes' if equal[label] else 'NO'} |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "kernels": lm.adapter.kernels,
            "isa": load_kernel().isa(),
            "results": results, "logits_equal": equal, "weight_bytes": held, "file_weight_bytes": in_file,
            "machine": machine_info(torch.device("cpu")),
            "versions": versions(),
            "commit": source_commit()}, indent=2))
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
