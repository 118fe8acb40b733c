import sys
sys.path.insert(0, "scripts")
import torch, numpy as np
import llamacpp_logits as L
import triedec
from triedec.model import gguf_blocks, precision
from triedec.bench.datasets import load_questions, select, split
from triedec.model.source import default_model_path
from llama_cpp import Llama
torch.set_num_threads(2)
model = sys.argv[1] if len(sys.argv) > 1 else None
lms = {"float32": triedec.load(model, weights="float"), "int4-a8 (file's blocks)": triedec.load(model, weights="int4-a8")}
read = dict(gguf_blocks._BLOCK_BYTES)
for k in precision.SCALE_MIN_KINDS: del gguf_blocks._BLOCK_BYTES[k]
lms["int4-a8 (int4's grid, before)"] = triedec.load(model, weights="int4-a8")
gguf_blocks._BLOCK_BYTES.update(read)
for n, lm in lms.items(): print(n, precision.layer_mix(lm.model), file=sys.stderr)
questions = select(split(load_questions("spec-bench"), "evaluation"), 2)
first = lms["float32"]
prompts = [first.prompts.encode(q.turns[0], chat=True) for q in questions]
gguf = model or default_model_path()
llm = Llama(model_path=str(gguf), n_ctx=max(map(len, prompts)) + 72, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
eos = int(llm.token_eos())
tot = {n: [0, 0.0] for n in lms}; pos = 0
for p in prompts:
    cont, theirs = L.llamacpp_continuation(llm, p, 64, eos)
    pos += len(cont)
    for n, lm in lms.items():
        a, kl = L.compare(lm, p, cont, theirs); tot[n][0] += a; tot[n][1] += kl
print(f"{gguf}: 12 Spec-Bench evaluation prompts, {pos} positions of llama.cpp's greedy answers (64 new tokens at most)")
print("| mode | top-1 agreement with llama.cpp | mean KL(llama.cpp ‖ mode), nats |\n|---|---|---|")
for n, (a, kl) in tot.items(): print(f"| {n} | {a / pos:.3f} | {kl / pos:.4f} |")
