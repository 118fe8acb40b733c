"""Microbenchmark: all 210 layer linears of a SmolLM2-135M-shaped model (distinct weights, so they stream from memory as in a real forward), MKL vs oneDNN dense vs pre-packed."""
import torch, time, statistics
torch.set_num_threads(2)
shapes = [(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
W = [torch.randn(*s) for _ in range(30) for s in shapes]
P = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in W]
def run(kind, M):
    xs = {576: torch.randn(M,576), 1536: torch.randn(M,1536)}
    def f():
        for w, p in zip(W, P):
            x = xs[w.shape[1]]
            if kind == "mkl": torch.nn.functional.linear(x, w)
            elif kind == "dense": torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            else: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    for _ in range(2): f()
    out=[]
    for _ in range(9):
        s=time.perf_counter(); f(); out.append(time.perf_counter()-s)
    return statistics.median(out)*1000
with torch.inference_mode():
    for M in (1,2,4,8,16,32,64):
        print(M, {k: round(run(k, M),1) for k in ("mkl","dense","packed")})
