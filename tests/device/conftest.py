"""The GPU-only tests (scripts/device_check.sh runs them on a machine lent a GPU) are not even collected
where torch sees no CUDA device: a CPU run neither runs nor counts them, not even as skipped."""

import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
