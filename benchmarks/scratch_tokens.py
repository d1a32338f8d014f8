"""Scratch (deleted before the branch is done): do greedy tokens stay equal to transformers' when every
block's linear layers compute with another kernel (a single copy of the weights)?"""
import tempfile
from pathlib import Path
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from threadpoolctl import threadpool_limits
from transformers import AutoTokenizer, BloomForCausalLM
from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR, write_random_checkpoint

torch.set_num_threads(1)
threadpool_limits(1, user_api="blas")

class Swapped(nn.Module):
    def __init__(self, linear, kind):
        super().__init__()
        self.kind, self.bias = kind, linear.bias
        if kind == "onednn-packed":
            self.w = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 8)
        elif kind == "openblas-input-major":
            self.w = linear.weight.detach().t().contiguous().numpy()
        else:
            self.w = linear.weight.detach()
    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        if self.kind == "openblas-input-major":
            out = torch.from_numpy(np.matmul(flat.numpy(), self.w)) + self.bias
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.w, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], -1)

def swapped(model, kind):
    import copy
    model = copy.deepcopy(model)
    for block in model.transformer.h:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Swapped(child, kind))
    return model

@torch.inference_mode()
def greedy(model, ids, steps):
    return model.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)[0, ids.shape[1]:]

def check(label, model, prompts, steps):
    for kind in ("onednn-packed", "onednn-plain", "openblas-input-major"):
        other = swapped(model, kind)
        same, total, logit_diff = 0, 0, 0.0
        for ids in prompts:
            with torch.inference_mode():
                a, b = model(ids).logits, other(ids).logits
            logit_diff = max(logit_diff, float((a - b).abs().max() / a.abs().max()))
            ta, tb = greedy(model, ids, steps), greedy(other, ids, steps)
            first = next((i for i, (x, y) in enumerate(zip(ta.tolist(), tb.tolist())) if x != y), None)
            same += int(first is None); total += 1
            if first is not None:
                print(f"   {label} {kind}: prompt {total} diverges at token {first}")
        print(f"{label:<28} {kind:<22} greedy sequences equal: {same}/{total}; prefill logits max |diff|/max|logit| {logit_diff:.1e}")

tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
text = (DEMO_MODEL_DIR / "heldout.txt").read_text()
ids = tok(text, return_tensors="pt").input_ids
demo = BloomForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
check("demo model (6 blocks, 256)", demo, [ids[:, s:s + 32] for s in range(0, 640, 64)], 48)
with tempfile.TemporaryDirectory() as tmp:
    for seed, hidden, blocks in [(1, 64, 4), (0, 64, 4), (2, 128, 2)]:
        path = write_random_checkpoint(Path(tmp) / f"m{seed}", num_blocks=blocks, hidden_size=hidden, num_heads=4, seed=seed)
        model = BloomForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = [torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(s)) for s in range(10)]
        check(f"tiny seed {seed} ({blocks} blocks, {hidden})", model, prompts, 32)
