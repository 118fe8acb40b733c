import sys, time, torch, triedec
from torch.profiler import profile, ProfilerActivity
from triedec.bench.datasets import load_questions, select, split
prompts = [q.turns[0] for q in select(split(load_questions("spec-bench"), "evaluation"), 1)]
for dtype in ("bfloat16", "float32"):
    lm = triedec.load("/tmp/smol.gguf", device="cuda", dtype=dtype)
    hf = lm.reference_model()
    tok = lm.tokenizer
    res = {}
    for name in ("hf", "ar", "auto", "hf", "ar", "auto"):
        n = 0; torch.cuda.synchronize(); t = time.perf_counter()
        for p in prompts:
            if name == "hf":
                ids = torch.tensor([lm.prompts.encode(p, chat=True)], device="cuda")
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
                n += out.shape[1] - ids.shape[1]
            else:
                n += len(lm.generate(p, name, max_new_tokens=64).token_ids)
        torch.cuda.synchronize()
        res.setdefault(name, []).append(n / (time.perf_counter() - t))
    print(dtype, {k: [round(x, 1) for x in v] for k, v in res.items()}, flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps = sum(lm.generate(p, "ar", max_new_tokens=16).stats.steps for p in prompts[:3])
        torch.cuda.synchronize()
    k = sum(e.self_device_time_total for e in prof.key_averages()) / 1000
    torch.cuda.synchronize(); t = time.perf_counter()
    steps2 = sum(lm.generate(p, "ar", max_new_tokens=16).stats.steps for p in prompts[:3])
    torch.cuda.synchronize(); w = (time.perf_counter() - t) * 1000
    print(dtype, f"ar: kernel ms/step {k/steps:.2f}, wall ms/step {w/steps2:.2f}", flush=True)
