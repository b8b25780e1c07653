"""A wall-clock stack sampler for processes we cannot attach a profiler to (Ray Serve actors on the GPU
machine, which has no py-spy): where the named threads spend their time.

    STACK_SAMPLES=/tmp/stacks python3 bench/stack_sampler.py --install /tmp/site  # once: a sitecustomize
    ... run anything whose processes import from /tmp/site, with STACK_SAMPLES set ...
    python3 bench/stack_sampler.py --report /tmp/stacks                          # the top stacks

Every process that starts with STACK_SAMPLES set samples its threads named in SAMPLED_THREADS every
SAMPLE_S, weighting each stack by the wall time since the previous sample, and rewrites
STACK_SAMPLES/<pid>-<thread>.json every second.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
from pathlib import Path

SAMPLED_THREADS = ("tileinfer-engine", "tileinfer-proposer")
SAMPLE_S = 0.002
FRAMES = 7  # innermost frames kept per stack

SITECUSTOMIZE = """import os
if os.environ.get("STACK_SAMPLES"):
    try:
        import bench.stack_sampler
        bench.stack_sampler.start(os.environ["STACK_SAMPLES"])
    except Exception:
        pass
"""


def _stack(frame) -> str:
    lines = []
    while frame is not None and len(lines) < FRAMES:
        code = frame.f_code
        lines.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " <- ".join(lines)


def _sample(out: Path) -> None:
    seconds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    last = time.monotonic()
    last_dump = last
    while True:
        time.sleep(SAMPLE_S)
        now = time.monotonic()
        elapsed, last = now - last, now
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            name = names.get(ident, "")
            if name in SAMPLED_THREADS:
                seconds[name][_stack(frame)] += elapsed
        if now - last_dump > 1.0 and seconds:
            last_dump = now
            for name, counts in seconds.items():
                (out / f"{os.getpid()}-{name}.json").write_text(json.dumps(counts.most_common(40)))


def start(directory: str) -> None:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_sample, args=(out,), name="stack-sampler", daemon=True).start()


def report(directory: str, top: int = 12) -> None:
    for path in sorted(Path(directory).glob("*.json")):
        counts = json.loads(path.read_text())
        total = sum(value for _, value in counts)
        print(f"== {path.name}: {total:.1f} s sampled")
        for stack, value in counts[:top]:
            print(f"{value:8.2f} s  {stack}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--install", help="write a sitecustomize.py that starts the sampler into this folder")
    parser.add_argument("--report", help="print the top stacks of this folder's samples")
    args = parser.parse_args()
    if args.install:
        Path(args.install).mkdir(parents=True, exist_ok=True)
        (Path(args.install) / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if args.report:
        report(args.report)


if __name__ == "__main__":
    main()
