"""lm-evaluation-harness through a swarm, next to lm-eval's own `hf` backend on the same weights in
the same run: wall time of each task, and how closely the results agree.

For each model: starts a bootstrap peer and N servers on 127.0.0.1 splitting the blocks, and a
`bloompeer api` over them; then times lm-eval (in this process, `simple_evaluate`) on two tasks
built from the demo model's held-out text (a local jsonl and a task yaml in a temp dir, nothing
downloaded):
  - mc: multiple choice, a line's true ending (cut at a space) among three other lines' endings;
  - gen: generate_until, the same beginnings, greedy, a few tokens;
once with its `local-completions` model pointed at the API (token-id prompts, a batch of prompts
per request, several requests in flight) and once with its `hf` model (the same batch size, one
process, all cores); each model object is made before the clock starts. Workloads per model are
in MODELS. The models: the demo model (bloompeer/demo_model), and the bloom-560m
architecture with random weights (written to a temp dir; only time and agreement matter).

    python benchmarks/evaluation.py                          # demo and bloom-560m
    python benchmarks/evaluation.py --models demo --servers 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BLOOM_560M = dict(num_blocks=24, hidden_size=1024, num_heads=16, vocab_size=250880, max_shard_size="1GB")
MODELS = {  # name -> (write_random_checkpoint arguments or None for the demo model, workload)
    "demo": (None, dict(cuts=(1 / 3, 1 / 2, 2 / 3), batch_size=8, concurrent=4, max_gen_toks=16)),
    # a CPU needs seconds per 560m forward of a batch: a lighter load, so that no request nears the
    # client's 30 s request timeout on a 2-core machine
    "bloom-560m": (BLOOM_560M, dict(cuts=(1 / 2,), batch_size=4, concurrent=2, max_gen_toks=8)),
}
TASK_YAML = """
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{text}}}}"
{extra}
"""
MC_EXTRA = """doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm"""
GEN_EXTRA = """doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match"""


def write_tasks(directory: Path, lines: list[str], cuts: tuple[float, ...], max_gen_toks: int) -> list[str]:
    """Two tasks over the held-out lines, a doc per line and cut; returns their names."""
    heads, tails, wholes = [], [], set()
    for line in lines:
        for fraction in cuts:  # where to cut, at the space before
            cut = line.rfind(" ", 0, max(8, int(len(line) * fraction)))
            # no two docs whose text and true ending read the same: lm-eval 0.4.13's hf model, with
            # its logits cache on (its default), computes requests with the same tokens once and
            # then scores all but one of them against the wrong context length
            if cut > 0 and line[:cut + 40] not in wholes:
                heads.append(line[:cut])
                tails.append(line[cut:cut + 40])
                wholes.add(line[:cut + 40])
    mc = [{"text": head, "choices": [tails[(i + 3 * k) % len(tails)] for k in range(4)], "answer": 0}
          for i, head in enumerate(heads)]
    gen = [{"text": head, "target": tail.split()[0] if tail.split() else ""} for head, tail in zip(heads, tails)]
    for name, rows, output_type, extra in (("bloompeer_bench_mc", mc, "multiple_choice", MC_EXTRA),
                                           ("bloompeer_bench_gen", gen, "generate_until",
                                            GEN_EXTRA.format(max_gen_toks=max_gen_toks))):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (directory / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data, output_type=output_type,
                                                                 extra=extra))
    return ["bloompeer_bench_mc", "bloompeer_bench_gen"]


def evaluate(lm_eval, task_manager, task: str, model) -> tuple[float, dict]:
    """Seconds of lm-eval's whole run of one task with a model object made beforehand (its loading not
    timed), and the results."""
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=task_manager, log_samples=True,
                                      bootstrap_iters=0)
    return time.perf_counter() - start, results


def make_model(lm_eval, name: str, model_args: dict, batch_size: int):
    from lm_eval.api.registry import get_model

    return get_model(name).create_from_arg_obj(model_args, {"batch_size": batch_size})


def agreement(task: str, swarm: dict, local: dict) -> str:
    """Loglikelihoods: the largest difference; generations: how many are identical; metrics: equal or not."""
    def samples(results):
        return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda sample: sample["doc_id"])]

    got, want = samples(swarm), samples(local)
    metrics_equal = swarm["results"][task] == local["results"][task]
    if task.endswith("_mc"):
        gap = max(abs(a[0][0] - b[0][0]) for doc_a, doc_b in zip(got, want) for a, b in zip(doc_a, doc_b))
        return f"max |d loglik| {gap:.1e}, metrics {'equal' if metrics_equal else 'DIFFER'}"
    same = sum(a == b for a, b in zip(got, want))
    return f"{same}/{len(want)} generations equal, metrics {'equal' if metrics_equal else 'DIFFER'}"


def metric(results: dict, task: str) -> str:
    values = results["results"][task]
    key = "acc,none" if "acc,none" in values else "exact_match,none"
    return f"{key.split(',')[0]} {float(values[key]):.3f}"


def bench(name: str, args: argparse.Namespace, lm_eval, lines: list[str], tmp: Path) -> None:
    """Prints a row per task as it is measured."""
    from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR, write_random_checkpoint
    from bloompeer.peer.cli.local_swarm import LocalSwarm, PeerProcess, split_blocks

    spec, load = MODELS[name]
    path = DEMO_MODEL_DIR if spec is None else write_random_checkpoint(tmp / name, **spec)
    num_blocks = json.loads((Path(path) / "config.json").read_text())["n_layer"]
    task_dir = tmp / f"tasks-{name}"
    task_dir.mkdir()
    tasks = write_tasks(task_dir, lines, load["cuts"], load["max_gen_toks"])
    task_manager = lm_eval.tasks.TaskManager(include_path=str(task_dir), include_defaults=False)
    print(f"[{name}] starting {args.servers} servers and the API...", file=sys.stderr, flush=True)
    with LocalSwarm(str(path), split_blocks(num_blocks, args.servers)) as swarm:
        api = PeerProcess("api", ["api", "--model", str(path), "--port", "0", "--initial-peers",
                                  *swarm.initial_peers], tmp)
        try:
            url = api.wait_for_line("api: ", time.monotonic() + 300).split(" ", 1)[1]
            with urllib.request.urlopen(f"{url}/models", timeout=60) as response:
                model_id = json.load(response)["data"][0]["id"]
            via_api = make_model(lm_eval, "local-completions", {
                "model": model_id, "base_url": f"{url}/completions", "tokenizer": str(path),
                "tokenizer_backend": "huggingface", "tokenized_requests": True,
                "num_concurrent": load["concurrent"], "max_retries": 1, "max_length": 2048}, load["batch_size"])
            hf = make_model(lm_eval, "hf", {"pretrained": str(path), "dtype": "float32", "device": "cpu"},
                            load["batch_size"])
            for task in tasks:
                print(f"[{name}] {task}: lm-eval through the swarm...", file=sys.stderr, flush=True)
                swarm_s, through_swarm = evaluate(lm_eval, task_manager, task, via_api)
                print(f"[{name}] {task}: lm-eval's hf backend...", file=sys.stderr, flush=True)
                local_s, local = evaluate(lm_eval, task_manager, task, hf)
                docs = len(local["samples"][task])
                print(f"{name:<11} {task.rsplit('_', 1)[1]:<4} {docs:>4} {load['batch_size']:>5} "
                      f"{load['concurrent']:>8} {local_s:>13.1f} {swarm_s:>12.1f} {swarm_s / local_s:>6.2f}  "
                      f"{metric(local, task):<18}  {agreement(task, through_swarm, local)}", flush=True)
        finally:
            api.stop()
            del hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--servers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bloompeer-bench-eval-") as tmp:
        for name, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                            "HF_DATASETS_CACHE": f"{tmp}/datasets"}.items():
            os.environ[name] = value  # before lm_eval (and datasets) read them
        import lm_eval
        import lm_eval.tasks
        import torch

        from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR

        lines = [line.strip() for line in (Path(DEMO_MODEL_DIR) / "heldout.txt").read_text().splitlines()
                 if len(line.split()) >= 4]
        print(f"lm-eval {lm_eval.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f}); {args.servers} servers on "
              f"127.0.0.1", flush=True)
        print(f"{'model':<11} {'task':<4} {'docs':>4} {'batch':>5} {'in flight':>8} {'lm-eval hf, s':>13} "
              f"{'via swarm, s':>12} {'ratio':>6}  {'hf result':<18}  agreement (swarm vs hf)", flush=True)
        for name in args.models:
            bench(name, args, lm_eval, lines, Path(tmp))
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
