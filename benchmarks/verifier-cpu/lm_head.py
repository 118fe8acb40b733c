"""Microbenchmark: the LM head (49152 x 576) and three layer shapes, MKL vs oneDNN (dense and pre-packed), 1-32 rows."""
import torch, time, statistics
torch.set_num_threads(2)
def t(f, reps=30):
    for _ in range(3): f()
    out=[]
    for _ in range(reps):
        s=time.perf_counter(); f(); out.append(time.perf_counter()-s)
    return statistics.median(out)*1000
for (n,k) in [(49152,576),(1536,576),(576,1536),(576,576)]:
    w = torch.randn(n,k); 
    packed = {m: torch.ops.mkldnn._reorder_linear_weight(w, m) for m in (1,16)}
    print("W", n, k, "packed type", packed[1].layout, packed[1].is_mkldnn if hasattr(packed[1],'is_mkldnn') else None, packed[1].shape)
    with torch.inference_mode():
        for M in (1,2,4,8,16,32):
            x = torch.randn(M,k)
            a = t(lambda: torch.nn.functional.linear(x,w))
            b = t(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
            c = t(lambda: torch.ops.mkldnn._linear_pointwise(x, packed[1], None, "none", [], ""))
            d = t(lambda: torch.ops.mkldnn._linear_pointwise(x, packed[16], None, "none", [], ""))
            print(f"M={M:3d} mkl {a:6.2f}  dnn-dense {b:6.2f}  packed1 {c:6.2f} packed16 {d:6.2f}")
