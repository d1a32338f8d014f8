"""How long PyTorch's OpenMP threads spin after a parallel op: set here, before torch loads.

libgomp (PyTorch's OpenMP on Linux) keeps its worker threads spinning after each parallel region
for GOMP_SPINCOUNT iterations, 300,000 by default: after one elementwise op on 2 threads, a worker
burnt 10.6 ms of CPU while its process slept 20 ms (0.35 ms with 10,000). A client computes its
LM head and sampling on every thread at every step, then waits for the swarm; meanwhile its spinning
worker takes a core from the servers that compute that step on the same machine (a local swarm,
a volunteer's client beside its server). On the 2-core VM, the demo model's step through 2 loopback
servers took 10.16 ms on average without this and 9.43 ms with it (3 runs each, alternating;
docs/performance.md); a pass's ops, issued back to back, still find the workers spinning.

libgomp reads the variable once, as it loads with torch; a user's own setting is kept.
"""

import os

SPIN_COUNT = "10000"  # about 0.3 ms of spinning: the gaps between one pass's ops, not the waits between passes

os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
