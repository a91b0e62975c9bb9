"""Host time of one gluon_attention_forward call (a loop of asynchronous calls on a tiny shape) beside the
kernel alone (CUDA-graph replay). PYTHONPATH=. python benchmarks/probes/gluon_host_overhead.py"""
import time, torch, triton
from flashdecode.ops.gluon_attention import gluon_attention_forward
q, k, v = (torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(3): gluon_attention_forward(q, k, v)
torch.cuda.synchronize()
n = 200; t = time.perf_counter()
for _ in range(n): gluon_attention_forward(q, k, v)
host = (time.perf_counter() - t) / n * 1e6
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g): gluon_attention_forward(q, k, v)
kern = triton.testing.do_bench(g.replay) * 1e3
print(f"host time per gluon_attention_forward call (tiny shape, async loop): {host:.1f} us; kernel alone (graph replay): {kern:.1f} us")
