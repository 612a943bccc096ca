"""The parsers of untrusted input under the grammar fuzzer of tests/support/grammar.py (hypothesis
strategies built from each grammar: mesh text, mesh JSON, mesh dicts, config TOML, config JSON,
config dicts, checkpoint manifests, safetensors headers, DCP .metadata pickles; --count inputs
per family), the mutation fuzzer of tests/support/fuzzing.py, and mutations of real checkpoints'
files (a unimesh save's manifest and data file, torch's own DCP .metadata and .distcp file),
each opened and read whole (tests/support/checkpoint_grammar.py).

    python benchmarks/fuzz.py [--count 100000] [--seed 0] [--memory-count 5000]
    python benchmarks/fuzz.py --families "mesh text,config toml" --count 1000

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
from tests.support import fuzzing, grammar

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
    parser.add_argument(
        "--families",
        default=",".join(grammar.FAMILIES),
        help="grammar families to run ('' for none)",
    )
    parser.add_argument("--no-mutation", action="store_true", help="skip the mutation fuzzer")
    parser.add_argument(
        "--no-checkpoints",
        dest="checkpoints",
        action="store_false",
        help="skip the mutations of real checkpoints",
    )
    args = parser.parse_args()
    bad = False
    every_n = max(1, args.count // max(1, args.memory_count))
    for family in filter(None, args.families.split(",")):
        run = grammar.drive(family, args.count, args.seed, memory_every=every_n)
        print(
            f"grammar {family:12s} {run.count:,} inputs in {run.seconds:.0f} s; outcomes: "
            + ", ".join(
                f"{k} {v:,}" for k, v in sorted(run.outcomes.items(), key=lambda kv: -kv[1])
            )
        )
        print(f"  slowest {run.slowest_ms_per_100kb:.2f} ms per 100 KB: {run.slowest}")
        print(
            f"  largest allocation peak ({run.count // every_n:,} traced): "
            f"{run.peak_bytes / 2**20:.2f} MiB: {run.peak_input}",
            flush=True,
        )
        for line in run.failures[:10]:
            print("  FAILURE", line)
        bad |= bool(run.failures) or run.slowest_ms_per_100kb > LIMIT_MS
    if args.checkpoints:  # mutations of real checkpoints' files (issue 37)
        from tests.support.checkpoint_grammar import mutate_checkpoints

        run = mutate_checkpoints(args.count, args.seed)
        print(f"checkpoint mutations {run.count:,} inputs in {run.seconds:.0f} s; outcomes:")
        for key, n in sorted(run.outcomes.items()):
            print(f"  {key:40s} {n:8,d}")
        print(f"  slowest (opened and every tensor read): {run.slowest}")
        for line in run.failures[:10]:
            print("  FAILURE", line)
        bad |= bool(run.failures) or run.slowest_ms_per_100kb > LIMIT_MS
    if args.no_mutation:
        print("FAIL" if bad else f"ok: only UnimeshError, every input under {LIMIT_MS:.0f} ms")
        return 1 if bad else 0
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
    bad |= bool(failures) or report.slowest_ms > LIMIT_MS
    print(
        "FAIL"
        if bad
        else f"ok: only UnimeshError, nothing evaluated, every input under {LIMIT_MS:.0f} ms"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
