"""The parsers of untrusted input under the mutation fuzzer of tests/fuzzing.py.

    python benchmarks/fuzz.py [--count 100000] [--seed 0] [--memory-count 5000]

Reports how many inputs each parser took, how they ended (accepted, or which UnimeshError), the
slowest input and its time (goal: none over 50 ms), and the largest allocation peak of one input
over a traced sample. Exit status 1 when an input raised anything but a UnimeshError, triggered
an evaluation/unpickling audit event, or took more than 50 ms.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import fuzzing

LIMIT_MS = 50.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--memory-count",
        type=int,
        default=5_000,
        help="inputs run again under tracemalloc for the memory peak",
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    report = fuzzing.run(
        args.count, args.seed, progress=lambda i: print(f"\r{i:,} inputs", end="", flush=True)
    )
    took = time.perf_counter() - t0
    mem = fuzzing.run(args.memory_count, args.seed + 1, memory=True)
    print(f"\r{report.count:,} inputs in {took:.0f} s ({report.count / took:,.0f}/s)")
    for name, n in sorted(report.by_target.items()):
        print(f"  {name:18s} {n:8,d}")
    print(
        f"accepted {report.accepted:,}; refused: "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(report.refused.items(), key=lambda kv: -kv[1]))
    )
    print(f"slowest input {report.slowest_ms:.2f} ms (goal <= {LIMIT_MS:.0f}): {report.slowest}")
    print(
        f"largest allocation peak of one input ({mem.count:,} traced): "
        f"{mem.peak_bytes / 2**20:.2f} MiB: {mem.peak_input}"
    )
    failures = report.failures + mem.failures
    for line in failures[:20]:
        print("FAILURE", line)
    bad = bool(failures) or report.slowest_ms > LIMIT_MS
    print(
        "FAIL"
        if bad
        else f"ok: only UnimeshError, nothing evaluated, every input under {LIMIT_MS:.0f} ms"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
