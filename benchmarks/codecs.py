"""Bytes on the wire and the error each codec adds, for real activations and gradients.

Uses the bundled demo model (trained, so its activations have the outliers real models have) on
its held-out text: the hidden states entering block 3 (what a server sends on in a forward) and the
gradient of the LM loss with respect to them (what it sends back in a backward). For each codec:
bytes, ratio to raw float32, relative L2 error, and encode + decode time; next to hivemind's
serializer (NONE and FLOAT16) on the same tensor as a baseline.

    python benchmarks/codecs.py
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import AutoTokenizer, BloomForCausalLM

from bloompeer.p2p import codecs
from bloompeer.p2p.tensors import FLOAT_DTYPES, tensor_from_wire, tensor_to_wire
from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR

REPEATS = 20


def activations_and_gradients() -> dict[str, torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model = BloomForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    ids = tokenizer((DEMO_MODEL_DIR / "heldout.txt").read_text(), return_tensors="pt").input_ids
    captured = {}

    def keep(module, args, kwargs):
        args[0].retain_grad()
        captured["hidden"] = args[0]

    hook = model.transformer.h[3].register_forward_pre_hook(keep, with_kwargs=True)
    model(ids, labels=ids).loss.backward()
    hook.remove()
    return {"activations": captured["hidden"].detach(), "gradients": captured["hidden"].grad}


def timed(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    print(f"{'tensor':<12} {'codec':<22} {'bytes':>9} {'vs raw':>7} {'rel. error':>11} {'enc+dec ms':>11}")
    for name, tensor in activations_and_gradients().items():
        raw_bytes = tensor.numel() * 4
        for codec in sorted(codecs.CODECS, key=lambda c: codecs.encoded_nbytes(c, tensor.numel(), tensor.dtype),
                            reverse=True):
            wire = tensor_to_wire(tensor, codec)
            decoded = tensor_from_wire(wire, name, FLOAT_DTYPES, tensor.ndim)
            error = float((decoded - tensor).norm() / tensor.norm())
            ms = timed(lambda: tensor_from_wire(tensor_to_wire(tensor, codec), name, FLOAT_DTYPES, tensor.ndim))
            print(f"{name:<12} {codec:<22} {len(wire['data']):>9} {len(wire['data']) / raw_bytes:>7.3f} "
                  f"{error:>11.2e} {ms:>11.3f}")
        for label, kind in [("hivemind NONE", runtime_pb2.NONE), ("hivemind FLOAT16", runtime_pb2.FLOAT16)]:
            proto = serialize_torch_tensor(tensor, kind)
            error = float((deserialize_torch_tensor(proto) - tensor).norm() / tensor.norm())
            ms = timed(lambda: deserialize_torch_tensor(serialize_torch_tensor(tensor, kind)))
            size = len(proto.buffer)
            print(f"{name:<12} {label:<22} {size:>9} {size / raw_bytes:>7.3f} {error:>11.2e} {ms:>11.3f}")


if __name__ == "__main__":
    main()
