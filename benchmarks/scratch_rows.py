import statistics, time, sys
import torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
torch.manual_seed(0)
n, k = 4096, 1024
w = torch.randn(n, k) * 0.02
def timed(fn, repeats=20):
    fn()
    t = []
    for _ in range(repeats):
        s = time.perf_counter(); fn(); t.append(time.perf_counter() - s)
    return 1e3 * min(t)
scale = w.abs().amax(1) / 127
q8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8); s8 = scale.bfloat16()
g = 64
wg = w.reshape(n, k // g, g); mn, mx = wg.amin(-1), wg.amax(-1)
s = ((mx - mn) / 15); z = mn + 8 * s
qi = torch.round((wg - mn[..., None]) / s[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
sz = torch.stack([s, z], -1).transpose(0, 1).contiguous().bfloat16()
p4 = torch._convert_weight_to_int4pack_for_cpu(qi, 2)
wbf = w.bfloat16()
for rows in (64, 512, 1024):
    x = torch.randn(rows, k); xb = x.bfloat16()
    print(rows, "f32 F.linear %.2f ms" % timed(lambda: F.linear(x, w)),
          "bf16 F.linear %.2f" % timed(lambda: F.linear(xb, wbf)),
          "int8 %.2f" % timed(lambda: torch._weight_int8pack_mm(xb, q8, s8)),
          "int4 %.2f" % timed(lambda: torch._weight_int4pack_mm_for_cpu(xb, p4, g, sz)),
          "deq8+f32 %.2f" % timed(lambda: F.linear(x, q8.float() * s8.float()[:, None])), flush=True)
