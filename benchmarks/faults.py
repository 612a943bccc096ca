"""Time to exit under each launcher's faults: 4 processes of tests/workers/verify_worker.py, where
process 1 is killed during set-up (die), never comes to the check (stuck: sleeps 40 s),
never starts the runtime (never: sleeps 40 s first; never0: process 0, JAX's coordinator) or
builds a different mesh (disagree); save-die and save-stuck are the first two during a
unimesh.save (torch and JAX). verify's and save's timeout is 15 s, initialize's 20 s.

    python benchmarks/faults.py [--engines torch,torchrun,jax,mpi,ring] [--modes die,stuck]

For every run: when the survivors reported (the "after N s" of their VERIFY lines, or the
watchdog's message for MLX), when the last survivor ended (per process for plain processes;
the launcher's end under a launcher, which ends the job on the first failure), and how many
of the survivors' messages name the missing or differing process. A markdown table on stdout.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.launch import run_bounded, run_ranks_timed
from tests.support.verify import WORKER, base_env, jax_envs, lines, mlx_command, torch_envs

N = 4
NAMES = {
    "torch": r"rank 1 did not arrive",
    "torchrun": r"rank 1 did not arrive",
    "jax": r"process 1 did not take part|process 1 of 4 did not start|process 0 of 4 \(the coord",
    "mpi": r"rank 1 never reached it",
    "ring": r"rank 1 never reached it",
}
MODES = {
    "torch": ["die", "stuck", "never", "disagree", "save-die", "save-stuck"],
    "torchrun": ["die", "stuck", "never", "disagree"],
    "jax": ["die", "stuck", "never", "never0", "disagree", "save-die", "save-stuck"],
    "mpi": ["die", "stuck", "never", "disagree"],
    "ring": ["die", "stuck", "never", "disagree"],
}
TIMEOUT = {"die": 15, "stuck": 15, "disagree": 15, "never": 20, "never0": 20, "save-die": 15,
           "save-stuck": 15}  # fmt: skip


def one(engine: str, mode: str, tmp: Path) -> dict[str, str]:
    """Run one fault; what the table shows of it."""
    gone = 0 if mode == "never0" else (None if mode == "disagree" else 1)
    t0 = time.monotonic()
    if engine in ("torch", "jax"):
        envs = torch_envs() if engine == "torch" else jax_envs()
        envs = [dict(env, CHECKPOINT_DIR=str(tmp / "ck")) for env in envs]  # save-* modes
        codes, outs, ends = run_ranks_timed([sys.executable, WORKER, engine, mode], envs, 120, tmp)
        out = "\n".join(outs)
        alive = [r for r in range(N) if r != gone]
        ended = max(ends[r] for r in alive)
        exits = ", ".join(str(codes[r]) for r in alive)
    else:
        if engine == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += [f"--nproc-per-node={N}", WORKER, "torch", mode]
        else:
            cmd = mlx_command("mpi" if engine == "mpi" else "ring", mode)
        rc, out = run_bounded(cmd, base_env(), 120, tmp)
        ended = time.monotonic() - t0
        exits = f"launcher {rc}"
    said = {r: v for r, v in lines(out).items() if r != gone}
    reported = [float(m) for m in re.findall(r"after ([\d.]+)s", " ".join(said.values()))]
    messages = list(said.values())
    if engine in ("mpi", "ring"):
        messages += re.findall(r"unimesh: .* did not finish within .*", out)
    pattern = r"processes \[1\] have device_order" if mode == "disagree" else NAMES[engine]
    named = sum(bool(re.search(pattern, m)) for m in messages)
    return {
        "engine": engine,
        "fault": mode,
        "timeout": f"{TIMEOUT[mode]} s",
        "reported": f"{min(reported):.1f}-{max(reported):.1f} s" if reported else "-",
        "ended": f"{ended:.1f} s",
        "named": f"{named} of {len(messages)}",
        "exits": exits,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(MODES))
    parser.add_argument("--modes", default="")
    args = parser.parse_args()
    import tempfile

    rows = []
    for engine in args.engines.split(","):
        for mode in MODES[engine]:
            if args.modes and mode not in args.modes.split(","):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                row = one(engine, mode, Path(tmp))
            print(" | ".join(row.values()), file=sys.stderr, flush=True)
            rows.append(row)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("| " + " | ".join("---" for _ in keys) + " |")
    for row in rows:
        print("| " + " | ".join(row[k] for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
