"""Crash trials: a save killed with SIGKILL at a random moment, ``--trials`` times per engine
(one process; every process of a 4-process torchrun and mpirun save). Each trial starts
tests/workers/checkpoint_crash_worker.py (it saves generation after generation into one path), waits
for its first save, then a random delay in [0, window), kills the whole job and reads the path
back: it must hold the last save that returned (``previous``) or the one in flight, committed
(``new``), whole and bit-exact. After the trials one more save must leave no file of the killed
ones behind.

    python benchmarks/crash.py [--trials 100] [--engines single,torchrun,mpirun]

A markdown table on stdout (the figures in docs/robustness.md).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.crashing import leftovers_after_a_save, trial

WINDOW = {"single": 0.6, "torchrun": 3.0, "mpirun": 3.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--engines", default="single,torchrun,mpirun")
    args = parser.parse_args()
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")},
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    print("| engine | trials | previous | new | broken | saves per trial | leftovers after "
          "the next save | seconds |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    failures = []
    for engine in args.engines.split(","):
        rng = random.Random(f"crash-{engine}")
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ck"
            results = [
                trial(engine, path, Path(tmp) / "logs", rng.uniform(0, WINDOW[engine]), env)
                for _ in range(args.trials)
            ]
            left = leftovers_after_a_save(path)
        outcomes = Counter(r["outcome"] for r in results)
        saves = [r.get("saves", 0) for r in results]
        failures += [r["why"] for r in results if r["outcome"] == "broken"]
        print(
            f"| {engine} | {len(results)} | {outcomes['previous']} | {outcomes['new']} | "
            f"{outcomes['broken']} | {min(saves)}-{max(saves)} | {len(left)} | "
            f"{time.monotonic() - t0:.0f} |",
            flush=True,
        )
    for why in failures[:5]:
        print(f"\nbroken: {why}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
