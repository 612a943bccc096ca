"""One process of a real run of the shard_map programs of program_cases.py (torchrun, mpirun or
mlx.launch). Started by tests/test_programs.py.

    python tests/workers/program_worker.py BACKEND REFERENCE.npz OUT_DIR

Every process runs every case with unimesh.value_and_grad, compares the loss and each gradient
with JAX's (from REFERENCE.npz) to 1e-5 (relative where they exceed 1), and writes
OUT_DIR/rank-R.json: {case: max error or
the error text}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import _support  # noqa: F401 - tests/support on sys.path, before its modules are imported
import numpy as np
import program_cases
import reshard_cases

import unimesh
from unimesh import P


def _error(got: dict[str, np.ndarray], want: Any, name: str) -> float | str:
    """The largest difference of a case's outputs from JAX's, relative to the size of the
    value (at least 1); text where the outputs themselves differ."""
    keys = sorted(k for k in want.files if k.startswith(name + ":"))
    missing = sorted({k.split(":", 1)[1] for k in keys} ^ set(got))
    if missing:
        return f"outputs differ from JAX's: {missing}"
    return max(
        float(
            np.max(
                np.abs(got[k.split(":", 1)[1]] - want[k]) / np.maximum(1.0, np.abs(want[k])),
                initial=0.0,
            )
        )
        for k in keys
    )


def _cross(backend: str, other: str, rank: int) -> dict[str, object]:
    """The second framework's runtime started in these processes (JAX: process id = torch's
    rank; torch under mpirun: RANK and WORLD_SIZE from Open MPI's), then reshard between the
    two, both ways."""
    try:
        if other == "jax":
            os.environ["JAX_PROCESS_ID"] = str(rank)
        else:
            os.environ["RANK"] = str(rank)
            os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        unimesh.initialize(other)
    except Exception:  # noqa: BLE001 - every case reports the failed start
        return {f"cross:{c[0]}": traceback.format_exc(limit=6)
                for c in reshard_cases.cross_cases(4, "jax")}  # fmt: skip
    return reshard_cases.run_cross(other if backend == "torch" else backend, 4, {rank})


def main() -> int:
    backend, reference, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rank, _ = unimesh.initialize(backend)
    mesh = unimesh.Mesh.from_string(program_cases.MESH)
    want = np.load(reference)
    report: dict[str, object] = {}
    for case in program_cases.CASES:
        if os.environ.get("UNIMESH_DEBUG"):
            print(f"rank {rank}: {case.name}", flush=True)
        try:
            report[case.name] = _error(program_cases.run(case, mesh, backend), want, case.name)
        except Exception:  # noqa: BLE001 - any failure is reported for this case
            report[case.name] = traceback.format_exc(limit=6)
    for case in program_cases.CASES:  # the same steps under unimesh.compile
        if case.name not in program_cases.COMPILED:
            continue
        try:
            got = program_cases.run(case, mesh, backend, compiled=True)
            report[f"compiled:{case.name}"] = _error(got, want, case.name)
        except Exception:  # noqa: BLE001 - any failure is reported for this case
            report[f"compiled:{case.name}"] = traceback.format_exc(limit=6)
    planned = program_cases.planned_names(backend)  # MLX: the gradient plan of every case
    for case in program_cases.CASES:
        if case.name not in planned:
            continue
        import mlx.core as mx

        mx.disable_compile()  # unimesh.compile still traces (and plans) on every call
        try:
            got = program_cases.run(case, mesh, backend, compiled=True)
            report[f"planned:{case.name}"] = _error(got, want, case.name)
        except Exception:  # noqa: BLE001 - any failure is reported for this case
            report[f"planned:{case.name}"] = traceback.format_exc(limit=6)
        finally:
            mx.enable_compile()
    try:  # the framework's own autodiff through a program
        native = program_cases.native_autodiff(mesh, backend)
        expected = want["issue-example:grad2"]
        error = float(np.max(np.abs(native["grad2"] - expected)))
        if "mixed" in native:  # the same parameter inside and outside the program
            w = next(c for c in program_cases.CASES if c.name == "issue-example").args[2]
            error = max(error, float(np.max(np.abs(native["mixed"] - (expected + 2 * w)))))
        if "compiled" in native:
            error = max(error, float(np.max(np.abs(native["compiled"] - expected))))
        report["native-autodiff"] = error
    except Exception:  # noqa: BLE001 - any failure is reported
        report["native-autodiff"] = traceback.format_exc(limit=6)
    if backend == "mlx":
        if unimesh.to_native(mesh, "mlx").axis_group("dp").group is not None:  # MPI, not ring
            try:
                report["gradient-communication"] = program_cases.mlx_gradient_communication(mesh)
            except Exception:  # noqa: BLE001 - any failure is reported
                report["gradient-communication"] = traceback.format_exc(limit=6)
        try:
            report["rules-only-when-traced"] = program_cases.mlx_rules_only_when_traced(mesh)
        except Exception:  # noqa: BLE001 - any failure is reported
            report["rules-only-when-traced"] = traceback.format_exc(limit=6)
        try:
            report["compiled-forward-without-rules"] = (
                program_cases.mlx_compiled_forward_without_rules(mesh)
            )
        except Exception:  # noqa: BLE001 - any failure is reported
            report["compiled-forward-without-rules"] = traceback.format_exc(limit=6)
        try:
            report["compiled-other-mesh"] = program_cases.mlx_compiled_other_mesh(mesh)
        except Exception:  # noqa: BLE001 - any failure is reported
            report["compiled-other-mesh"] = traceback.format_exc(limit=6)
    if getattr(unimesh.get_backend(backend), "check_vma", False):  # JAX's check_vma refusal too
        try:
            unimesh.shard_map(lambda b: b * 2, mesh, P("dp"), P(), backend=backend)(
                np.ones((4, 2), np.float32)
            )
            report["typed-refusal"] = "a result varying along dp was accepted under out_spec P()"
        except unimesh.LayoutError as exc:
            ok = "varies along ('dp',)" in str(exc) and "out_spec P()" in str(exc)
            report["typed-refusal"] = 0.0 if ok else f"unexpected message: {exc}"
        try:  # the same under unimesh.compile (torch.compile, fullgraph): the same error
            bad = unimesh.shard_map(lambda b: b * 2, mesh, P("dp"), P(), backend=backend)
            x = unimesh.distribute(
                np.ones((4, 2), np.float32), unimesh.Layout(mesh, P("dp")), backend=backend
            )
            options = program_cases.COMPILE_OPTIONS.get(backend, {})
            unimesh.compile(bad, backend=backend, compiler_options=options, fullgraph=True)(x)
            report["typed-refusal-compiled"] = "accepted under compile"
        except unimesh.LayoutError as exc:
            ok = "varies along ('dp',)" in str(exc) and "out_spec P()" in str(exc)
            report["typed-refusal-compiled"] = 0.0 if ok else f"unexpected message: {exc}"
        except Exception:  # noqa: BLE001 - any other failure is reported
            report["typed-refusal-compiled"] = traceback.format_exc(limit=6)
    if backend == "torch":
        try:
            report["full-array-bfloat16"] = program_cases.full_array_bfloat16(mesh, backend)
        except Exception:  # noqa: BLE001 - any failure is reported
            report["full-array-bfloat16"] = traceback.format_exc(limit=6)
    try:
        report["psum-small-ints"] = program_cases.psum_small_ints(mesh, backend)
    except Exception:  # noqa: BLE001 - any failure is reported
        report["psum-small-ints"] = traceback.format_exc(limit=6)
    # unimesh.reshard on this launch's 4 processes (sub-meshes: torch only, an MLX mesh spans
    # the world)
    report.update(reshard_cases.run_all(backend, 4, {rank}, subsets=backend == "torch"))
    other = os.environ.get("UNIMESH_CROSS")  # a second framework in the same processes
    if other:
        report.update(_cross(backend, other, rank))
    # last, since a hang here ends the launch: the cases above are written first
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(report, indent=1))
    print(
        f"rank {rank}: unused-collective (a hang here: a collective's result that one process "
        "leaves unused never ran there)",
        flush=True,
    )
    try:
        report["unused-collective"] = program_cases.unused_collective(mesh, backend)
    except Exception:  # noqa: BLE001 - any failure is reported
        report["unused-collective"] = traceback.format_exc(limit=6)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(report, indent=1))
    print(f"RANK {rank} done {len(report)} cases", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
