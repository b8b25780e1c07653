"""Which processes are busy while a benchmark runs: every second, the CPU share of each process whose
command line matches (Ray's workers name themselves ray::<actor>), from /proc, with no profiler.

    python3 bench/cpu_sampler.py OUT.jsonl &        # sample until killed
    python3 bench/cpu_sampler.py --report OUT.jsonl --marks LOG   # mean CPU per phase

LOG: lines "<unix time> <phase>" (bench/serve_load.py writes them with --marks), which split the
samples into phases; each phase's busiest processes are listed, in cores (1.0 = one core all the time).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MATCH = ("ray::", "serve_load", "raylet", "gcs_server", "uvicorn")


def _processes() -> dict[int, tuple[str, int]]:
    """pid -> (label, CPU ticks so far) for the matching processes."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if not any(word in command for word in MATCH):
            continue
        label = command.split()[0] if command.startswith("ray::") else " ".join(command.split()[:3])[-60:]
        found[int(entry.name)] = (label, int(fields[11]) + int(fields[12]))  # utime + stime
    return found


def sample(out: Path, interval_s: float = 1.0) -> None:
    before, last = _processes(), time.time()
    with out.open("a") as file:
        while True:
            time.sleep(interval_s)
            now, current = time.time(), _processes()
            elapsed = now - last
            cores: dict[str, float] = collections.defaultdict(float)
            for pid, (label, ticks) in current.items():
                if pid in before:
                    cores[f"{label} [{pid}]"] += (ticks - before[pid][1]) / TICKS / elapsed
            file.write(
                json.dumps({"t": now, "cores": {k: round(v, 3) for k, v in cores.items() if v > 0.02}})
            )
            file.write("\n")
            file.flush()
            before, last = current, now


def report(samples: Path, marks: Path | None, top: int = 6) -> None:
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    phases: list[tuple[float, str]] = []
    if marks is not None and marks.exists():
        for line in marks.read_text().splitlines():
            stamp, _, name = line.partition(" ")
            phases.append((float(stamp), name))
    phases.append((float("inf"), "end"))
    for (start, name), (end, _) in zip(phases, phases[1:], strict=False):
        inside = [row for row in rows if start <= row["t"] < end]
        if not inside:
            continue
        total: dict[str, float] = collections.defaultdict(float)
        for row in inside:
            for label, value in row["cores"].items():
                total[label] += value / len(inside)
        busiest = sorted(total.items(), key=lambda item: -item[1])[:top]
        print(f"{name} ({len(inside)} s): " + "; ".join(f"{label} {value:.2f}" for label, value in busiest))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("samples")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--marks", default=None)
    args = parser.parse_args()
    if args.report:
        report(Path(args.samples), Path(args.marks) if args.marks else None)
    else:
        sample(Path(args.samples))


if __name__ == "__main__":
    main()
