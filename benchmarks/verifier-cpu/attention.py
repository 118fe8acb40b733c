"""Microbenchmark: sdpa under a tree mask on a 512-token cache, 9 query heads / 3 KV heads: K/V copied per head (transformers) vs read in place (enable_gqa)."""
import torch, time, statistics
import torch.nn.functional as F
torch.set_num_threads(2)
def t(f, reps=50):
    for _ in range(3): f()
    out=[]
    for _ in range(reps):
        s=time.perf_counter(); f(); out.append(time.perf_counter()-s)
    return statistics.median(out)*1e6
L=512
with torch.inference_mode():
  for T in (1, 8, 16, 64):
    q=torch.randn(1,9,T,64); k=torch.randn(1,3,L+T,64); v=torch.randn(1,3,L+T,64)
    m=torch.zeros(1,1,T,L+T)
    rk = lambda: (F.scaled_dot_product_attention(q, k.repeat_interleave(3,1), v.repeat_interleave(3,1), attn_mask=m))
    g = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    a=rk(); b=g(); print(T, "repeat", round(t(rk)), "gqa", round(t(g)), "diff", (a-b).abs().max().item())
