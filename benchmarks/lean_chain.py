"""The floor under issue 42's per-hop figure: the same decode step through the leanest chain of server
processes Python allows, measured beside our swarm in the same run (benchmarks/step_anatomy.py).

Two server processes hold the model's blocks as bloompeer's spans and session caches, the client the
embeddings and head as transformers' modules. A step goes client -> server 1 -> server 2 -> client
over loopback TCP with blocking sockets (TCP_NODELAY): a 4-byte length and a msgpack map of the raw
hidden states, nothing checked, no asyncio, no libp2p daemon, no scheduler, metrics or copies kept for
replay, and a plain greedy loop instead of transformers' generate. The same loop runs the same blocks
in this process, a step of each in turn, so that the machine's drift hits both alike. What the chain
then costs beyond its blocks' compute is what any chain of processes costs on this machine: process
wake-ups, loopback TCP, a cache that is colder in each of two processes than in one.

    python benchmarks/lean_chain.py MODEL_DIR     # alone: prints the floor for a model directory
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import bloompeer  # noqa: F401  (before torch, as in its CLI: bloompeer/_openmp.py)
import msgpack
import torch

from bloompeer.blocks import open_checkpoint
from bloompeer.blocks.families import family_for_model_type

MAX_LENGTH = 512


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray(count)
    view, received = memoryview(data), 0
    while received < count:
        chunk = sock.recv_into(view[received:])
        if not chunk:
            raise EOFError
        received += chunk
    return bytes(data)


def _receive(sock: socket.socket) -> dict:
    return msgpack.unpackb(_receive_exactly(sock, struct.unpack(">I", _receive_exactly(sock, 4))[0]))


def _send(sock: socket.socket, message: dict) -> None:
    data = msgpack.packb(message)
    sock.sendall(struct.pack(">I", len(data)) + data)


def _frame(position: int, hidden: torch.Tensor, compute_s: float) -> dict:
    return {"position": position, "shape": list(hidden.shape), "data": hidden.contiguous().numpy().tobytes(),
            "compute_s": compute_s}


def _hidden(frame: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(frame["data"]), dtype=torch.float32).view(frame["shape"])


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _accept(listener: socket.socket) -> socket.socket:
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _listener() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener


def serve(model: str, start: int, end: int, next_port: int) -> None:
    """A server process: prints its port, takes one stream in, passes each step's output to `next_port`, adding
    its blocks' compute time to the frame's."""
    torch.set_num_threads(1)  # two servers on the machine's two cores
    span = open_checkpoint(model).load_span(start, end, torch.float32)
    listener = _listener()
    print(f"port {listener.getsockname()[1]}", flush=True)
    inbound = _accept(listener)
    outbound = _connect(next_port)
    cache = None
    with torch.inference_mode():
        while True:
            try:
                frame = _receive(inbound)
            except EOFError:
                return
            hidden, position = _hidden(frame), frame["position"]
            if position == 0:
                cache = span.new_cache(start, end, 1, MAX_LENGTH, torch.float32)
            started = time.perf_counter()
            output = span(hidden, cache.begin_step(position, None, hidden.shape[1]), cache)
            _send(outbound, _frame(position, output, frame["compute_s"] + time.perf_counter() - started))


@contextlib.contextmanager
def lean_chain(model: str, spans: list[tuple[int, int]]) -> Iterator[Callable[[int, torch.Tensor], tuple]]:
    """Start the chain's servers (the last first: each connects on to the next); yields step(position, hidden)
    -> (output, the servers' compute seconds). The servers are killed on exit, also on failure."""
    back = _listener()
    processes, next_port = [], back.getsockname()[1]
    try:
        for start, end in reversed(spans):
            process = subprocess.Popen([sys.executable, __file__, "serve", model, str(start), str(end), str(next_port)],
                                       stdout=subprocess.PIPE, text=True)
            processes.append(process)
            line = process.stdout.readline()
            if not line.startswith("port "):
                raise RuntimeError(f"a lean-chain server did not start (it printed {line!r})")
            next_port = int(line.split()[1])
        first = _connect(next_port)
        answers = _accept(back)

        def step(position: int, hidden: torch.Tensor) -> tuple[torch.Tensor, float]:
            _send(first, _frame(position, hidden, 0.0))
            frame = _receive(answers)
            return _hidden(frame), frame["compute_s"]

        yield step
        first.close()
    finally:
        for process in processes:
            process.kill()
            process.wait()
        back.close()


def paired_steps(model: str, spans: list[tuple[int, int]], prompt: torch.Tensor, new_tokens: int) -> dict:
    """Greedy decoding of `prompt` through the lean chain and through the same blocks in this process, a step of
    each in turn: per decode step (the prompt's left out), seconds of {"local", "local blocks", "chain",
    "chain blocks"} (blocks: the blocks' compute alone), and under "tokens differ" the steps whose greedy token
    the chain did not compute as the local loop did (none: both run the same blocks on the same inputs)."""
    embed, head = _client_modules(model)
    local_span = open_checkpoint(model).load_span(spans[0][0], spans[-1][1], torch.float32)
    times = {"local": [], "local blocks": [], "chain": [], "chain blocks": [], "tokens differ": []}
    with lean_chain(model, spans) as chain, torch.inference_mode():
        cache = local_span.new_cache(local_span.start, local_span.end, 1, MAX_LENGTH, torch.float32)

        def local(position: int, hidden: torch.Tensor) -> tuple[torch.Tensor, float]:
            started = time.perf_counter()
            output = local_span(hidden, cache.begin_step(position, None, hidden.shape[1]), cache)
            return output, time.perf_counter() - started

        runners = {"local": [local, embed(prompt), 0], "chain": [chain, embed(prompt), 0]}
        for index in range(new_tokens):
            tokens = []
            for name, runner in runners.items():
                run, hidden, position = runner
                started = time.perf_counter()
                output, blocks_s = run(position, hidden)
                tokens.append(head(output[:, -1:]).argmax(-1))
                runner[1:] = [embed(tokens[-1]), position + hidden.shape[1]]
                if index:  # the prompt's pass is not a decode step
                    times[name].append(time.perf_counter() - started)
                    times[f"{name} blocks"].append(blocks_s)
            if not torch.equal(*tokens):
                times["tokens differ"].append(index)
    return times


def _client_modules(model: str) -> tuple[Callable, Callable]:
    """(ids -> what the first block takes, last hidden -> logits), transformers' own modules of the model."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    parts, base = family_for_model_type(reference.config.model_type).client, reference.base_model
    embeddings, final_norm = getattr(base, parts.embeddings), getattr(base, parts.final_norm)
    embedding_norm = getattr(base, parts.embedding_norm) if parts.embedding_norm else (lambda hidden: hidden)
    return (lambda ids: embedding_norm(embeddings(ids))), (lambda hidden: reference.lm_head(final_norm(hidden)))


def summary(times: dict) -> dict[str, float]:
    """Medians in ms, and the two per-hop figures of a chain of two servers."""
    ms = {name: statistics.median(values) * 1000 for name, values in times.items() if name != "tokens differ"}
    paired = statistics.median(c - l for c, l in zip(times["chain"], times["local"])) * 1000
    return {**ms, "per-hop by the formula": (ms["chain"] - ms["chain blocks"]) / 2,
            "per-hop beyond the local loop": paired / 2, "steps whose tokens differ": len(times["tokens differ"])}


def main() -> None:
    model = sys.argv[1]
    num_blocks = open_checkpoint(model).config().num_hidden_layers
    spans = [(0, num_blocks // 2), (num_blocks // 2, num_blocks)]
    prompt = torch.randint(4, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    for name, value in summary(paired_steps(model, spans, prompt, 200)).items():
        print(f"{name:<32}{value:8d}" if isinstance(value, int) else f"{name:<32}{value:8.3f} ms")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
