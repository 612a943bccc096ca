"""Runs the cases of jax_suite.py (JAX's own shard_map tests, ported). Started by
tests/test_jax_suite.py.

    python tests/workers/jax_suite_worker.py reference OUT_DIR
        JAX's own run of every case (jax.shard_map, jax.lax, check_vma, float64 on 8 CPU
        devices) into OUT_DIR/reference.npz, then the ported run on unimesh's JAX backend in
        the same process, compared: OUT_DIR/jax-rank-0.json
    python tests/workers/jax_suite_worker.py BACKEND OUT_DIR   (torchrun or mpirun, 4 processes)
        every case through unimesh on BACKEND in float64, compared with OUT_DIR/reference.npz:
        OUT_DIR/BACKEND-rank-R.json, {case: null (agrees) or what differs}

Values per device (each process's own blocks), whole values and gradients are compared to
1e-9 relative (float64 on both sides); on MLX to 1e-6, as MLX's own float64 sin and cos are
only float32-accurate (its arithmetic and collectives are exact float64).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import _support  # noqa: F401 - tests/support on sys.path, before its modules are imported
import numpy as np

TOL = {"mlx": 1e-6}


def _report(backend: str, rank: int, out_dir: Path, want: dict[str, np.ndarray]) -> None:
    import jax_suite

    report: dict[str, str | None] = {}
    for case in jax_suite.cases():
        if os.environ.get("UNIMESH_DEBUG"):
            print(f"rank {rank}: {case.name}", flush=True)
        prefix = case.name + ":"
        mine = {k[len(prefix) :]: v for k, v in want.items() if k.startswith(prefix)}
        try:
            got = jax_suite.ported(case, backend)
            report[case.name] = jax_suite.compare(mine, got, TOL.get(backend, 1e-9))
        except Exception:  # noqa: BLE001 - any failure is this case's result
            report[case.name] = traceback.format_exc(limit=8)
    (out_dir / f"{backend}-rank-{rank}.json").write_text(json.dumps(report, indent=1))
    print(f"{backend} rank {rank}: {len(report)} cases", flush=True)


def main() -> int:
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    if mode == "reference":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax

        jax.config.update("jax_enable_x64", True)
        import jax_suite

        arrays: dict[str, np.ndarray] = {}
        for case in jax_suite.cases():
            if not case.expressible:
                continue
            for key, value in jax_suite.reference(case).items():
                arrays[f"{case.name}:{key}"] = value
        np.savez(out_dir / "reference.npz", **arrays)
        _report("jax", 0, out_dir, arrays)
        return 0
    import unimesh

    rank, _ = unimesh.initialize(mode)
    with np.load(out_dir / "reference.npz") as data:
        want = {k: data[k] for k in data.files}
    _report(mode, rank, out_dir, want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
