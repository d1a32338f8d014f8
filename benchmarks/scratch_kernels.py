"""Scratch: issue 27's kernel figures (deleted before the branch is done)."""
import statistics, time, sys
import torch
import torch.nn.functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
n, k = 4096, 1024
w = torch.randn(n, k) * 0.02
b = torch.randn(n) * 0.02

def timed(fn, repeats=200):
    for _ in range(10): fn()
    t = []
    for _ in range(repeats):
        s = time.perf_counter(); fn(); t.append(time.perf_counter() - s)
    return 1e6 * statistics.median(t), 1e6 * min(t)

def int8(w):
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale

def int4(w, g):
    wg = w.reshape(n, k // g, g)
    mn, mx = wg.amin(-1), wg.amax(-1)
    s = ((mx - mn) / 15).clamp(min=1e-6)
    z = mn + 8 * s
    qi = torch.round((wg - mn[..., None]) / s[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.stack([s, z], -1).transpose(0, 1).contiguous()
    return torch._convert_weight_to_int4pack_for_cpu(qi, 2), sz

q8, s8 = int8(w)
s8b = s8.to(torch.bfloat16)
packs = {g: int4(w, g) for g in (32, 64, 128, 256)}
print(f"{'kernel':<26} {'rows':>4} {'median us':>10} {'min us':>8} {'rel err vs f32':>15}")
for rows in (1, 8):
    x = torch.randn(rows, k)
    ref = F.linear(x, w, b)
    def err(y): return ((y.float() - ref).norm() / ref.norm()).item()
    cands = {
        "F.linear f32": lambda: F.linear(x, w, b),
        "int8 bf16 x": lambda: torch._weight_int8pack_mm(x.to(torch.bfloat16), q8, s8b).to(torch.float32).add_(b),
        "int8 f32 x": lambda: torch._weight_int8pack_mm(x, q8, s8).add_(b),
    }
    for g, (p, sz) in packs.items():
        szb = sz.to(torch.bfloat16)
        cands[f"int4 g{g} bf16 x"] = (lambda p=p, szb=szb, g=g: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), p, g, szb).to(torch.float32).add_(b))
        cands[f"int4 g{g} f32 x"] = (lambda p=p, sz=sz, g=g: torch._weight_int4pack_mm_for_cpu(x, p, g, sz).add_(b))
    for name, fn in cands.items():
        med, mn = timed(fn)
        print(f"{name:<26} {rows:>4} {med:>10.0f} {mn:>8.0f} {err(fn()):>15.2e}")
