"""Scratch (deleted before the branch is done): one copy of the float32 weights for 1-row and batched passes?"""
import statistics, sys, time
import numpy as np
import torch
import torch.nn.functional as F
from threadpoolctl import threadpool_limits

torch.set_num_threads(1)
limits = threadpool_limits(1, user_api="blas")
torch.manual_seed(0)
SHAPES = [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]  # (in, out) per block
BLOCKS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 15
ROWS = (1, 8, 64)
layers = []
for _ in range(BLOCKS):
    for i, o in SHAPES:
        w = torch.randn(o, i) * i ** -0.5
        b = torch.randn(o) * 0.02
        wt = w.t().contiguous()
        layers.append(dict(w=w, b=b, wt=wt, w_np=w.numpy(), wt_np=wt.numpy(), b_np=b.numpy()))

def pack_all():
    for L in layers:
        L["onednn"] = torch.ops.mkldnn._reorder_linear_weight(L["w"], 8)
        L["mklpack1"] = torch.ops.mkl._mkl_reorder_linear_weight(L["w"], 1)
        L["mklpack8"] = torch.ops.mkl._mkl_reorder_linear_weight(L["w"], 8)
pack_all()

def cand(name):
    return {
        "F.linear on W (MKL; today's 1 row)": lambda L, x: F.linear(x, L["w"], L["b"]),
        "OpenBLAS on input-major copy (today's batched)": lambda L, x: torch.from_numpy(np.matmul(x.numpy(), L["wt_np"])).add_(L["b"]),
        "OpenBLAS on W, transposed view": lambda L, x: torch.from_numpy(np.matmul(x.numpy(), L["w_np"].T)).add_(L["b"]),
        "F.linear on input-major copy's .t() view (MKL)": lambda L, x: F.linear(x, L["wt"].t(), L["b"]),
        "torch.addmm(b, x, W.t()) (MKL)": lambda L, x: torch.addmm(L["b"], x, L["w"].t()),
        "torch.mm then add (MKL)": lambda L, x: torch.mm(x, L["w"].t()).add_(L["b"]),
        "oneDNN prepacked (_linear_pointwise)": lambda L, x: torch.ops.mkldnn._linear_pointwise(x, L["onednn"], L["b"], "none", [], ""),
        "oneDNN on W itself (_linear_pointwise, no copy)": lambda L, x: torch.ops.mkldnn._linear_pointwise(x, L["w"], L["b"], "none", [], ""),
        "MKL packed GEMM, packed for 1 row": lambda L, x: torch.ops.mkl._mkl_linear(x, L["mklpack1"], L["w"], L["b"], 1),
        "MKL packed GEMM, packed for 8 rows": lambda L, x: torch.ops.mkl._mkl_linear(x, L["mklpack8"], L["w"], L["b"], 8),
        "MKL GEMV row by row (F.linear per row)": lambda L, x: torch.cat([F.linear(r, L["w"], L["b"]) for r in x.split(1)]),
    }[name]

import os
ALL_NAMES = ["F.linear on W (MKL; today's 1 row)", "OpenBLAS on input-major copy (today's batched)", "OpenBLAS on W, transposed view",
         "F.linear on input-major copy's .t() view (MKL)", "torch.addmm(b, x, W.t()) (MKL)", "torch.mm then add (MKL)",
         "oneDNN prepacked (_linear_pointwise)", "oneDNN on W itself (_linear_pointwise, no copy)", "MKL packed GEMM, packed for 1 row", "MKL packed GEMM, packed for 8 rows",
         "MKL GEMV row by row (F.linear per row)"]
NAMES = [n for i, n in enumerate(ALL_NAMES) if os.environ.get("PICK") is None or str(i) in os.environ["PICK"].split(",")]

def ulps(a, b):
    ai, bi = a.view(torch.int32).long(), b.view(torch.int32).long()
    ai = torch.where(ai < 0, -(ai & 0x7FFFFFFF), ai); bi = torch.where(bi < 0, -(bi & 0x7FFFFFFF), bi)
    return (ai - bi).abs()

inputs = {rows: {i: torch.randn(rows, i) for i in (1024, 4096)} for rows in ROWS}
def run_pass(fn, rows):
    for L in layers:
        fn(L, inputs[rows][L["w"].shape[1]])

results = {}
with torch.no_grad():
    for rows in ROWS:
        for name in NAMES:
            fn = cand(name)
            run_pass(fn, rows)
        times = {name: [] for name in NAMES}
        cpu = {name: [] for name in NAMES}
        for _ in range(REPEATS):  # round robin, so load changes hit every candidate alike
            for name in NAMES:
                fn = cand(name)
                c = time.thread_time(); s = time.perf_counter(); run_pass(fn, rows)
                times[name].append(time.perf_counter() - s); cpu[name].append(time.thread_time() - c)
        for name in NAMES:
            results[(name, rows)] = (1e3 * statistics.median(cpu[name]), 1e3 * min(times[name]))
    # distance to F.linear, 1 row and 8 rows, over all layers
    dist = {}
    for rows in (1, 8):
        for name in NAMES:
            fn = cand(name)
            worst, equal, total = 0.0, 0, 0
            for L in layers:
                x = inputs[rows][L["w"].shape[1]]
                alone = torch.cat([F.linear(r, L["w"], L["b"]) for r in x.split(1)])
                out = fn(L, x)
                scale = F.linear(x.abs().double(), L["w"].abs().double(), L["b"].abs().double())
                worst = max(worst, float(((out.double() - alone.double()).abs() / scale).max()))
                equal += int((out == alone).sum()); total += out.numel()
            dist[(name, rows)] = (worst / 2**-24, equal / total)

print(f"{BLOCKS} blocks x 4 linear layers (hidden 1024), 1 thread, {REPEATS} passes round robin; ms per pass: median CPU time of the thread / min wall")
print("distance to a request alone (F.linear on W, one row at a time): max |diff| / (u * sum|x w|), u = 2^-24; share bitwise equal")
head = "".join(f"{f'{r} row' + ('s' if r > 1 else '') + ' ms':>16}" for r in ROWS)
print(f"{'candidate':<50}{head} {'1 row: dist, equal':>20} {'8 rows: dist, equal':>20}")
for name in NAMES:
    cells = "".join(f"{results[(name, r)][0]:>8.1f} /{results[(name, r)][1]:>6.1f}" for r in ROWS)
    d1, d8 = dist[(name, 1)], dist[(name, 8)]
    print(f"{name:<50}{cells} {d1[0]:>10.2f}, {d1[1]:>6.1%} {d8[0]:>10.2f}, {d8[1]:>6.1%}")
