"""A newcomer's first command, timed: `bloompeer generate "Once upon a time"` on a fresh machine.

Each run is the real command in a new process, with no swarm given (so it starts a local swarm
of a bootstrap peer and two servers on the demo model) and with a fresh HOME and cache
directory (no measured throughput, no identities). It prints when each phase ended, from
  - the command's own output, timed here as it arrives: the log lines on stderr, the first
    generated text after the prompt on stdout (first token), the last text, the exit;
  - the local swarm's logs (generate --swarm-logs, where the version has it): when the bootstrap
    peer and each server were up, and the seconds of each step of a server's start, as the
    server's "Started in" line gives them;
beside the floor measured in the same run: a bare `python -c "import torch, transformers"`; and
the CPU seconds that the command and all its processes used (on a shared machine, wall-clock
figures are as much the other jobs' as ours).

    python benchmarks/first_run.py                       # 3 runs of this checkout
    python benchmarks/first_run.py --compare /tmp/old    # alternating with another checkout

--compare DIR runs another bloompeer checkout (a directory with the bloompeer package), one run
of each in turn, so that both meet the same machine load. The machine's load average is printed
with each figure's runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARENT_EVENTS = {  # event -> the start of a line the command logs on stderr
    "CLI ready, swarm starting": "No --initial-peers given",
    "client loading embeddings": "Loading embeddings and layernorms",
    "route found": "Route for blocks",
}
LOG_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d)(?:\.(\d{3}))? ")
STEP = re.compile(r"([a-zA-Z][a-zA-Z0-9 ]*?) (\d+\.\d+) s")


@dataclass
class Run:
    events: dict[str, float] = field(default_factory=dict)  # seconds after the command started
    server_steps: list[dict[str, float]] = field(default_factory=list)  # each server's start, step -> seconds
    stdout: str = ""
    returncode: int | None = None
    cpu_s: float = float("nan")  # user + system seconds of the command and every process under it


def _fresh_env(pythonpath: Path, home: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items()
           if name not in ("BLOOMPEER_INITIAL_PEERS", "BLOOMPEER_CACHE", "XDG_CACHE_HOME")}
    return {**env, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONPATH": str(pythonpath)}


def _supports_swarm_logs(pythonpath: Path) -> bool:
    with tempfile.TemporaryDirectory() as home:
        result = subprocess.run([sys.executable, "-m", "bloompeer", "generate", "--help"], capture_output=True,
                                text=True, env=_fresh_env(pythonpath, Path(home)), cwd=home)
    return "--swarm-logs" in result.stdout


def _children_cpu_s() -> float:
    """CPU seconds of this process's ended children and, as each reaped its own, of theirs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _log_seconds(line: str, started_wall: float) -> float | None:
    """A log line's HH:MM:SS[.mmm] as seconds after `started_wall` (the same day)."""
    match = LOG_TIME.match(line)
    if match is None:
        return None
    hours, minutes, seconds, millis = match.groups()
    day = datetime.datetime.fromtimestamp(started_wall).replace(hour=0, minute=0, second=0, microsecond=0)
    stamp = day.timestamp() + int(hours) * 3600 + int(minutes) * 60 + int(seconds) + int(millis or 0) / 1000
    return stamp - started_wall


def run_once(pythonpath: Path, prompt: str, swarm_logs: bool) -> Run:
    run = Run()
    with tempfile.TemporaryDirectory(prefix="bloompeer-first-run-") as tmp:
        home, logs = Path(tmp) / "home", Path(tmp) / "logs"
        home.mkdir()
        command = [sys.executable, "-m", "bloompeer", "generate", prompt]
        if swarm_logs:
            command += ["--swarm-logs", str(logs)]
        cpu_before = _children_cpu_s()
        started_wall, started = time.time(), time.monotonic()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=_fresh_env(pythonpath, home), cwd=tmp)
        chunks: list[tuple[float, bytes]] = []
        stderr_lines: list[tuple[float, str]] = []

        def read_stdout() -> None:
            while chunk := os.read(process.stdout.fileno(), 4096):
                chunks.append((time.monotonic() - started, chunk))

        def read_stderr() -> None:
            for line in process.stderr:
                stderr_lines.append((time.monotonic() - started, line.decode(errors="replace")))

        readers = [threading.Thread(target=read_stdout), threading.Thread(target=read_stderr)]
        for reader in readers:
            reader.start()
        run.returncode = process.wait()
        run.events["exit"] = time.monotonic() - started
        run.cpu_s = _children_cpu_s() - cpu_before
        for reader in readers:
            reader.join()
        run.stdout = b"".join(chunk for _, chunk in chunks).decode(errors="replace")
        if run.returncode != 0:
            sys.exit(f"the command failed ({run.returncode}):\n" + "".join(line for _, line in stderr_lines)[-3000:])
        for event, start in PARENT_EVENTS.items():
            run.events[event] = next((at for at, line in stderr_lines if start in line), float("nan"))
        printed = 0
        for at, chunk in chunks:  # the first text after the prompt, and the last text
            printed += len(chunk)
            if printed > len(prompt.encode()) and "first token" not in run.events:
                run.events["first token"] = at
            if chunk.strip():
                run.events["last token"] = at
        if swarm_logs:
            _read_swarm_logs(logs, started_wall, run)
    return run


def _read_swarm_logs(logs: Path, started_wall: float, run: Run) -> None:
    for line in (logs / "bootstrap.log").read_text().splitlines():
        if "Bootstrap peer" in line:
            run.events["bootstrap peer up"] = _log_seconds(line, started_wall)
    onlines = []
    for log in sorted(logs.glob("server*.log")):
        for line in log.read_text().splitlines():
            if "Started in" in line:
                onlines.append(_log_seconds(line, started_wall))
                steps = line.split("Started in", 1)[1].split(":", 1)[1]
                run.server_steps.append({name.strip(): float(seconds) for name, seconds in STEP.findall(steps)})
    if onlines:
        run.events["first server online"], run.events["all servers online"] = min(onlines), max(onlines)


def floor_seconds(pythonpath: Path, code: str) -> float:
    with tempfile.TemporaryDirectory() as home:
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", code], check=True, env=_fresh_env(pythonpath, Path(home)), cwd=home)
        return time.monotonic() - started


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # not NaN
    return statistics.median(values) if values else float("nan")


def _load() -> str:
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def report(name: str, runs: list[Run], floors: list[float], loads: list[str]) -> None:
    def at(event: str) -> float:
        return _median([run.events.get(event, float("nan")) for run in runs])

    print(f"\n## {name}: {len(runs)} run(s); load average (1, 5, 15 min) before each: {'; '.join(loads)}")
    print(f"{'event (median seconds after the command started)':<52}{'at':>8}")
    events = ["CLI ready, swarm starting", "bootstrap peer up", "first server online", "all servers online",
              "client loading embeddings", "route found", "first token", "last token", "exit"]
    for event in events:
        print(f"  {event:<50}{at(event):8.2f}")
    print(f"{'phase':<52}{'seconds':>8}")
    phases = [
        ("interpreter start, imports, CLI", None, "CLI ready, swarm starting"),
        ("local swarm start (until all servers online)", "CLI ready, swarm starting", "all servers online"),
        ("  bootstrap peer (from the swarm's start)", "CLI ready, swarm starting", "bootstrap peer up"),
        ("client: embeddings, network, route", "client loading embeddings", "route found"),
        ("first step (prompt through the swarm)", "route found", "first token"),
        ("generation (first token to last)", "first token", "last token"),
        ("shutdown (last token to exit)", "last token", "exit"),
    ]
    for label, start, end in phases:
        print(f"  {label:<50}{at(end) - (at(start) if start else 0.0):8.2f}")
    steps = sorted({step for run in runs for server in run.server_steps for step in server},
                   key=lambda step: min(list(server).index(step) for run in runs for server in run.server_steps
                                        if step in server))
    if steps:
        print("  a server's start, step by step (median of the servers):")
        for step in steps:
            print(f"    {step:<48}{_median([s.get(step, float('nan')) for r in runs for s in r.server_steps]):8.2f}")
    else:
        print("  (a server's steps: not in this version's logs)")
    print(f"  {'FIRST TOKEN':<50}{at('first token'):8.2f}")
    print(f"  {'TOTAL':<50}{at('exit'):8.2f}")
    print(f"  {'CPU seconds, all its processes together':<50}{_median([run.cpu_s for run in runs]):8.2f}")
    floor = 'floor: python -c "import torch, transformers"'
    print(f"  {floor:<50}{_median(floors):8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each version (3)")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--compare", type=Path, default=None, metavar="DIR",
                        help="another checkout (a directory holding the bloompeer package), run in turn with this one")
    args = parser.parse_args()
    versions = {"this checkout": REPO}
    if args.compare is not None:
        versions = {f"compared: {args.compare}": args.compare.resolve(), **versions}
    logs = {name: _supports_swarm_logs(path) for name, path in versions.items()}
    runs: dict[str, list[Run]] = {name: [] for name in versions}
    floors: dict[str, list[float]] = {name: [] for name in versions}
    loads: dict[str, list[str]] = {name: [] for name in versions}
    for index in range(args.runs):
        for name, path in versions.items():
            loads[name].append(_load())
            floors[name].append(floor_seconds(path, "import torch, transformers"))
            runs[name].append(run_once(path, args.prompt, logs[name]))
            print(f"run {index + 1}/{args.runs} of {name}: first token {runs[name][-1].events['first token']:.2f} s, "
                  f"total {runs[name][-1].events['exit']:.2f} s (load {loads[name][-1]})", file=sys.stderr, flush=True)
    texts = {run.stdout for version in runs.values() for run in version}
    if len(texts) != 1:
        sys.exit(f"the versions printed different texts: {texts}")
    print(f"bloompeer generate {args.prompt!r}, fresh HOME and caches; {os.cpu_count()} CPU cores. It printed:")
    print("  " + texts.pop().strip())
    for name in versions:
        report(name, runs[name], floors[name], loads[name])


if __name__ == "__main__":
    main()
