"""Measure the grammar engines on this CPU: mask time per token and the cost of walking a tree.

Run: ``python scripts/grammar_engines.py [--tokenizer DIR ...] [--gguf FILE ...]`` (default: the
default model's; ``--gguf`` reads a GGUF's tokenizer, e.g. Gemma 3's 262k vocabulary from
``bash scripts/get-models.sh``'s ``models/gemma-3-270m-q4_k_m.gguf``). For each engine (llguidance,
and xgrammar when installed) and tokenizer: compile a JSON schema (llguidance with the layout triedec
serves, ``triedec.api.grammar.JSON_OPTIONS``), then follow a valid instance token by token, timing
the allowed-token mask at every step (the cost ``ar`` pays each step), a consume + rollback (what
checking one tree node costs) and, for llguidance, the forced tokens after a path of up to 4 tokens
(what extending a drafted leaf costs). Prints medians and p90s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "role", "score"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1 \"A\""}, "role": "admin", "score": 98.5}


def stats(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs) * 1e6:7.1f} us  p90 {xs[int(0.9 * (len(xs) - 1))] * 1e6:7.1f} us"


def run_llguidance(tok, ids: list[int]) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok)
    tok_s = time.perf_counter() - started
    started = time.perf_counter()
    from triedec.api.grammar import JSON_OPTIONS

    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS)
    m = llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - started
    mask = llguidance.torch.allocate_token_bitmask(1, lt.vocab_size)
    masks, nodes, leaves, forced = [], [], [], 0
    for k, t in enumerate(ids):
        path = ids[k: k + 4]
        started = time.perf_counter()
        consumed = m.try_consume_tokens(path)
        m.compute_ff_tokens()
        m.rollback(consumed)
        leaves.append(time.perf_counter() - started)
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        masks.append(time.perf_counter() - started)
        started = time.perf_counter()
        ok = m.consume_token(t)
        m.rollback(1)
        nodes.append(time.perf_counter() - started)
        forced += len(m.compute_ff_tokens()) > 0
        assert ok and m.consume_token(t), m.get_error()
    print(f"  llguidance: tokenizer {tok_s:.2f} s, compile {compile_s * 1e3:.1f} ms; mask {stats(masks)}; "
          f"consume+rollback {stats(nodes)}; forced after a 4-token path {stats(leaves)}; "
          f"steps with forced tokens {forced}/{len(ids)}; "
          f"accepting {m.is_accepting()}")


def run_xgrammar(tok, ids: list[int]) -> None:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    tok_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    m = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - started
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    masks, nodes = [], []
    for t in ids:
        started = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        masks.append(time.perf_counter() - started)
        started = time.perf_counter()
        ok = m.accept_token(t)
        m.rollback(1)
        nodes.append(time.perf_counter() - started)
        assert ok and m.accept_token(t)
    print(f"  xgrammar:   tokenizer {tok_s:.2f} s, compile {compile_s * 1e3:.1f} ms; mask {stats(masks)}; "
          f"accept+rollback {stats(nodes)}; terminated {m.is_terminated()}")


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", action="append", default=[],
                        help="a tokenizer directory (default: the default model's)")
    parser.add_argument("--gguf", action="append", default=[], help="a GGUF file whose tokenizer to use")
    args = parser.parse_args()
    tokenizers = [(d, lambda d=d: AutoTokenizer.from_pretrained(d)) for d in args.tokenizer]
    tokenizers += [(g, lambda g=g: AutoTokenizer.from_pretrained(str(Path(g).parent), gguf_file=Path(g).name))
                   for g in args.gguf]
    if not tokenizers:
        from triedec.model.source import converted_gguf_dir, default_model_path
        d = str(converted_gguf_dir(default_model_path()))
        tokenizers = [(d, lambda: AutoTokenizer.from_pretrained(d))]
    text = json.dumps(INSTANCE, separators=(", ", ": "))
    for name, make in tokenizers:
        tok = make()
        ids = tok.encode(text, add_special_tokens=False)
        print(f"{name}: vocab {len(tok)}, {len(ids)} tokens")
        run_llguidance(tok, ids)
        try:
            run_xgrammar(tok, ids)
        except ImportError:
            print("  xgrammar:   not installed (pip install xgrammar)")


if __name__ == "__main__":
    main()
