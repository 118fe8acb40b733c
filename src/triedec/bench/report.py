"""Benchmark outputs: ``results.json``, ``results.md`` and PNG plots, plus the machine description."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from triedec.bench.runners import OWN_BASELINE, REFERENCE
from triedec.bench.stats import ratio_interval, ratio_text
from triedec.bench.summary import LOW_REPETITION, units
from triedec.core.sampling import Sampling


def source_commit() -> str:
    """The git commit triedec runs from (``+dirty`` with uncommitted changes), or ``unknown``."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}+dirty" if dirty else commit


VERSIONED = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "gguf", "triedec", "llama-cpp-python")


def versions() -> dict[str, str]:
    """The versions of Python and of the packages a run's numbers depend on."""
    out = {"python": platform.python_version()}
    for pkg in VERSIONED:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def machine_info(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "triedec": version("triedec"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _sampling_text(results: dict[str, Any]) -> str:
    sampling = Sampling(**results.get("sampling", {}))
    if sampling.greedy:
        return "greedy decoding"
    given = {k: v for k, v in sampling.as_dict().items() if k != "seed" and v != getattr(Sampling(), k)}
    return ("sampling (" + ", ".join(f"{k} {v:g}" for k, v in given.items())
            + f"; prompt k sampled with seed {sampling.seed or 0} + k by every method)")


def _cmp(c: dict[str, Any] | None) -> str:
    """A paired comparison as ``1.23x [1.10, 1.35]`` (geometric mean, 95% interval)."""
    return ratio_text(c)


def _protocol(results: dict[str, Any]) -> str:
    state = results.get("state", "cold")
    where = ("every method reset before each timed run (one request, nothing learned carried)" if state == "cold"
             else "learned state carried across the sample in file order, reset before each repeat")
    warm = ", ".join(results.get("warmup_prompts", [])) or "none"
    return (f"- protocol: state **{state}** ({where}); {results.get('order', 'fixed method order')}; "
            f"{results['repeats']} repeat(s), a prompt's time = the median of its repeats; split "
            f"{results.get('split', '?')}; warm-up prompts (untimed, outside the sample): {warm}")


def _not_compared(results: dict[str, Any]) -> str:
    """Why stock transformers' tokens are not compared in this run."""
    if not Sampling(**results.get("sampling", {})).greedy:
        return " (— = not compared: transformers' sampling draws from torch's RNG, not from the seed's positions)"
    return (f" (— = not compared: in {results.get('precision')} transformers' attention breaks bf16 near-ties "
            "differently from triedec's; triedec's `ar` is the bit-exact reference in every mode)")


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    reference = results.get("reference", REFERENCE)
    token_reference = results.get("token_reference", REFERENCE)
    methods = results["methods"]
    lines = [
        f"# triedec bench: {results['dataset']}",
        "",
        f"- command: `{results['command']}`",
        f"- model: {results['model']}; max_new_tokens {results['max_new_tokens']}; {results['questions']} questions, "
        f"{results['turns']} prompts; sample sha256 {str(results.get('sample_sha256', '?'))[:12]}",
        _protocol(results),
        f"- machine: {m['cpu']}, {m['cpu_count']} cores, {m['torch_threads']} torch threads, device {m['device']}"
        + (f" ({m['gpu']})" if "gpu" in m else "") + f"; {m['platform']}",
        f"- commit {results.get('commit', 'unknown')}; versions: torch {m['torch']}, transformers {m['transformers']}, "
        f"triedec {m['triedec']}, Python {m['python']}; triedec precision "
        f"{results.get('precision', 'float32')}, kernels: {results.get('kernels', 'plain')} "
        f"({results.get('exactness', 'exactness not recorded')}); baselines: stock transformers",
        f"- decoding: {_sampling_text(results)}",
        f"- vs triedec ar / vs stock = per-prompt speedups (the method's tokens/s over `ar`'s, over `{reference}`'s, "
        "on the same prompt): geometric mean [95% bootstrap interval over questions, a question's turns drawn "
        "together; none under 10 questions: (n=prompts)]; Spec-Bench speedup = mean "
        f"tokens/s / mean tokens/s of `{reference}`; MAT = tokens per decoding step; computed/token = tokens through "
        f"the model (prompt excluded) per generated token; mismatches = prompts whose tokens differ from "
        f"`{token_reference}`'s"
        + (_not_compared(results) if token_reference != reference else "") + ".",
        "",
        "| method | tokens/s | vs triedec ar | vs stock | Spec-Bench speedup | MAT | computed/token | mismatches "
        "| peak mem MB | KV MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in methods.items():
        o = res["overall"]
        wrong = f"**WRONG** ({o['mismatches']} mismatches)"
        speed = wrong if o["wrong"] else f"{_fmt(o['speedup'])}x"
        lines.append(
            f"| {name} | {_fmt(o['tokens_per_s'], 1)} | {_cmp(o.get('vs_ar'))} | "
            f"{wrong if o['wrong'] else _cmp(o.get('vs_reference'))} | {speed} | {_fmt(o['mean_accepted'])} | "
            f"{_fmt(o['computed_per_token'])} | {o['mismatches'] if o.get('compared', 1) else '—'} | "
            f"{_fmt(o['peak_mem_mb'], 0)} | {_fmt(o['kv_mb'], 1)} |"
        )
    if any(name.split(":")[0] == "llamacpp" for name in methods):
        version = results.get("versions", {}).get("llama-cpp-python", "?")
        lines += ["", f"`llamacpp` is llama.cpp (llama-cpp-python {version}) running the GGUF file itself: "
                  "quantized weights and llama.cpp's kernels, so its tokens are not the fp32 model's and are not "
                  "compared; its speed answers 'is this faster than llama.cpp on this CPU', not 'is this exact'."]
    verdicts = []
    for name, res in methods.items():
        for key, base, label in (("vs_ar", "triedec ar", OWN_BASELINE), ("vs_reference", reference, reference)):
            c = res["overall"].get(key)
            if c and name != label:
                verdicts.append(f"- {name} vs {base}: {c['verdict']} ({_cmp(c)}, {c['prompts']} prompts)")
    if verdicts:
        lines += ["", "Paired verdicts (faster or slower only where the 95% interval excludes 1):", "", *verdicts]
    lead = results.get("leader")
    if lead:
        lines += ["", f"The fastest exact method, `{lead['method']}`, paired against every other (its tokens/s over "
                  "theirs per prompt):", ""]
        lines += [f"- vs {m}: {'—' if c is None else c['verdict']} ({_cmp(c)})" for m, c in lead["against"].items()]
    ref = methods.get(token_reference)
    if ref:
        cats = {**ref["by_category"], **ref.get("by_turn", {}), **ref.get("slices", {})}
        lines += ["", f"How repetitive `{token_reference}`'s outputs are: self-repetition = the mean share of an "
                  "output's 4-grams that already occurred earlier in it; prompt copy = the mean share found in its "
                  f"prompt; low_repetition = prompts with both at most {LOW_REPETITION:g} (lookup methods gain from "
                  "both):", "",
                  "| | overall | " + " | ".join(cats) + " |", "|---" * (len(cats) + 2) + "|",
                  "| self-repetition | " + _fmt(ref["overall"].get("repeated_4grams")) + " | "
                  + " | ".join(_fmt(c.get("repeated_4grams")) for c in cats.values()) + " |",
                  "| prompt copy | " + _fmt(ref["overall"].get("prompt_copy_4grams")) + " | "
                  + " | ".join(_fmt(c.get("prompt_copy_4grams")) for c in cats.values()) + " |",
                  f"| prompts | {ref['overall']['samples']} | " + " | ".join(str(c["samples"]) for c in cats.values())
                  + " |"]
    mismatched = [s for s in results.get("samples", []) if s.get("first_mismatch")]
    if mismatched:
        lines += ["", "Mismatches: where each first differs from the reference, and how close the decision was there "
                  "under stock transformers' logits: greedy, the top-2 logit gap (~1e-4 or less: a near-tie that "
                  "another fp32 kernel may break either way); sampling, the draw's distance to the edge of the "
                  "reference token's CDF interval (~1e-5 or less: fp32 noise of another batch shape):", "",
                  "| method | prompt | position | reference token | token | top-2 gap / CDF margin |",
                  "|---|---|---|---|---|---|"]
        for smp in mismatched:
            fm = smp["first_mismatch"]
            gap = fm.get("top2_gap", fm.get("cdf_margin"))
            lines.append(f"| {smp['method']} | {smp['id']} | {fm['position']} | {fm['reference_token']} | "
                         f"{fm['token']} | {'—' if gap is None else f'{gap:.2e}'} |")
    split = {name: res["overall"] for name, res in results["methods"].items() if "verify_per_token" in res["overall"]}
    if split:
        lines += ["", "Lookahead's computed tokens split (per generated token): all = the table's computed/token; "
                  "verify = the verification branch alone (the lookahead branch is the same in both modes):", "",
                  "| method | computed tokens | all / token | verify / token |", "|---|---|---|---|"]
        lines += [f"| {name} | {o['computed_tokens']} | {_fmt(o['computed_per_token'])} | "
                  f"{_fmt(o['verify_per_token'])} |" for name, o in split.items()]
    groups = list(dict.fromkeys(c for r in methods.values()
                                for c in [*r["by_category"], *r.get("by_turn", {}), *r.get("slices", {})]))
    for key, base in (("vs_ar", "triedec ar"), ("vs_reference", reference)):
        lines += ["", f"Per-prompt speedup vs {base} by category (MT-bench both turns and each turn; the "
                  "low-repetition slice): geometric mean [95% interval] (n=k: only k prompts, too few for an "
                  "interval; WRONG = output differs from the reference):",
                  "", "| method | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
        for name, res in methods.items():
            every = {**res["by_category"], **res.get("by_turn", {}), **res.get("slices", {})}
            cells = []
            for g in groups:
                cm = every.get(g)
                cells.append("" if cm is None else ("WRONG" if cm["wrong"] else _cmp(cm.get(key))))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    passes = list(dict.fromkeys(p for r in results["methods"].values() for p in r.get("by_pass", {})))
    if passes:
        lines += ["", "By pass (the same questions asked again in pass 2, rephrased): tokens/s and speedup over "
                  f"`{reference}`; the last column is the method's pass-{passes[-1]} tokens/s over its pass-"
                  f"{passes[0]} tokens/s:", "",
                  "| method | " + " | ".join(f"pass {p} tokens/s | pass {p} speedup" for p in passes)
                  + " | last / first pass |", "|---|" + "---|---|" * len(passes) + "---|"]
        for name, res in results["methods"].items():
            by = res.get("by_pass", {})
            cells = []
            for p in passes:
                o = by.get(p)
                cells += ["", ""] if o is None else [_fmt(o["tokens_per_s"], 1),
                                                     "WRONG" if o["wrong"] else f"{_fmt(o['speedup'])}x"]
            first, last = by.get(passes[0]), by.get(passes[-1])
            gain = f"{last['tokens_per_s'] / first['tokens_per_s']:.2f}x" if first and last and \
                first["tokens_per_s"] else "—"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {gain} |")
    deep = {name: res["overall"] for name, res in results["methods"].items()
            if any(x > 0 for x in res["overall"].get("acceptance_by_depth", []))}
    if deep:
        depth = max(len(o["acceptance_by_depth"]) for o in deep.values())
        lines += ["", "Acceptance by depth (share of steps whose tree reached depth d that accepted >= d drafts, "
                  "mean over runs) and the drafter's own counters after its last run:", "",
                  "| method | " + " | ".join(f"d={d + 1}" for d in range(depth)) + " | drafter |",
                  "|---|" + "---|" * (depth + 1)]
        for name, o in deep.items():
            rates = o["acceptance_by_depth"]
            cells = [_fmt(rates[d]) if d < len(rates) else "" for d in range(depth)]
            extra = ", ".join(f"{k} {v:.3g}" for k, v in o.get("drafter", {}).items())
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {extra} |")
    if results.get("skipped"):
        lines += ["", f"Skipped (prompt + max_new_tokens beyond the model's context): {len(results['skipped'])}"]
    for failure in results.get("failed", []):
        lines += ["", f"**{failure['method']} failed** on {failure['prompt']} and was dropped from this run (the "
                      f"other methods went on; none of its runs is counted): `{failure['error']}`"]
    return "\n".join(lines) + "\n"


def _bar_labels(ax: Any, xs: Sequence[float], tops: Sequence[float], counts: Sequence[int | None]) -> None:
    """``n=<count>`` above each bar (above its interval where it has one)."""
    for x, top, n in zip(xs, tops, counts, strict=True):
        if n is not None:
            ax.annotate(f"n={n}", (x, top), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                        fontsize=6, rotation=90)


def speedup_figure(results: dict[str, Any]) -> Any:
    """Each method's speedup over the reference per category and overall: the geometric mean of
    per-prompt speedups, with its 95% bootstrap interval as an error bar and its number of prompts
    above it (``vs_reference`` in ``results.json``); wrong methods hatched."""
    import matplotlib.pyplot as plt

    methods = results["methods"]
    names = list(methods)
    reference = results.get("reference", REFERENCE)
    categories = [*dict.fromkeys(c for r in methods.values() for c in r["by_category"]), "overall"]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.5 * len(categories) + 2), 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        parts = [methods[name]["by_category"].get(c) or {} for c in categories[:-1]] + [methods[name]["overall"]]
        cmp = [p.get("vs_reference") or {} for p in parts]
        vals = [c.get("geomean", 0.0) for c in cmp]
        ci = [c.get("ci95") for c in cmp]
        low = [v - c[0] if c else 0.0 for v, c in zip(vals, ci, strict=True)]
        high = [c[1] - v if c else 0.0 for v, c in zip(vals, ci, strict=True)]
        xs = [j + i * width for j in range(len(categories))]
        wrong = methods[name]["overall"]["wrong"]
        ax.bar(xs, vals, width, yerr=[low, high], capsize=2, error_kw={"linewidth": 0.8},
               label=name + (" (WRONG)" if wrong else ""), hatch="xx" if wrong else None)
        _bar_labels(ax, xs, [c[1] if c else v for v, c in zip(vals, ci, strict=True)],
                    [c.get("prompts") for c in cmp])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(categories))], categories, rotation=20)
    ax.set_ylabel(f"speedup over {reference} (tokens/s ratio)")
    ax.set_title(f"Speedup over {reference}: geometric mean of per-prompt ratios, 95% bootstrap interval, "
                 "n = prompts", fontsize=9)
    ax.margins(y=0.15)
    ax.legend(fontsize=7)
    return fig


def accepted_figure(results: dict[str, Any], samples: Sequence[dict]) -> Any:
    """Each method's mean accepted tokens per step (tokens of its decoding steps over its steps,
    as ``results.json`` computes it) with a 95% bootstrap interval over prompts and the number of
    prompts above the bar."""
    import matplotlib.pyplot as plt

    names = list(results["methods"])
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(names) + 2), 3.8))
    vals, low, high, counts, tops = [], [], [], [], []
    question = units(samples)  # each prompt id's question: its unit of resampling
    for name in names:
        value = results["methods"][name]["overall"]["mean_accepted"]
        per_prompt: dict[str, list[float]] = {}
        for r in samples:
            if r["method"] == name and r.get("steps"):
                tokens_steps = per_prompt.setdefault(str(r["id"]), [0.0, 0.0])
                tokens_steps[0] += max(r["new_tokens"] - 1, 0)
                tokens_steps[1] += r["steps"]
        ci = ratio_interval([t for t, _ in per_prompt.values()], [s for _, s in per_prompt.values()],
                            units=[question.get(k, k) for k in per_prompt])
        vals.append(value)
        low.append(value - ci[0] if ci else 0.0)
        high.append(ci[1] - value if ci else 0.0)
        tops.append(ci[1] if ci else value)
        counts.append(len(per_prompt))
    ax.bar(range(len(names)), vals, yerr=[low, high], capsize=3, color="tab:green")
    _bar_labels(ax, list(range(len(names))), tops, counts)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("accepted tokens per step")
    ax.set_title("Tokens per decoding step (1.0 = plain decoding), 95% bootstrap interval, n = prompts", fontsize=9)
    ax.margins(y=0.15)
    return fig


def plots(results: dict[str, Any], samples: Sequence[dict], out: Path) -> list[Path]:
    """The speedup and tokens-per-step bar charts (each bar with its interval and its number of
    prompts) and speed against context length, as PNG files in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["methods"])
    files = []

    def _save(fig: Any, path: Path) -> Path:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    files.append(_save(speedup_figure(results), out / "speedup_by_category.png"))
    files.append(_save(accepted_figure(results, samples), out / "mean_accepted.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in names:
        rows = [r for r in samples if r["method"] == name and r["seconds"] > 0]
        ax.scatter([r["prompt_tokens"] for r in rows], [r["new_tokens"] / r["seconds"] for r in rows],
                   label=name, s=14, alpha=0.75)
    ax.set_xlabel("context length (prompt tokens)")
    ax.set_ylabel("tokens/s")
    ax.set_title("Speed against context length (one point per prompt)")
    ax.legend(fontsize=8)
    files.append(_save(fig, out / "tokens_per_s_vs_context.png"))
    return files


def write_outputs(results: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.md", *plots(results, results["samples"], out)]
