"""Checkpoint speed side by side, in one run, on one process with 8 JAX CPU devices (issue 37,
item 3, first part): the limit of this machine measured in the same run (pwrite + fsync and
pread of the same bytes, warm and cold, and a host memcpy), unimesh's save / async_save / load
(same layout and a reshard), and the incumbents on the same state: safetensors (save_file,
and safe_open + get_slice of the same blocks), torch DCP (dcp.save / dcp.load, one process)
and Orbax (StandardCheckpointer on the same jax.Arrays).

    python benchmarks/bench_checkpoint.py [--mib 1024] [--dir DIR] [--json FILE]

The state: float32 4096-column matrices, two bfloat16 copies, replicated biases and one
uneven 4097-row matrix, about --mib MiB in all, laid out 4 x 2 over 8 devices. Prints one
line per measurement (``BENCH system operation seconds GB/s fraction-of-limit``) and writes the
rows as JSON, and the peak memory of a load beyond the arrays it returns (in a fresh process).
The multi-process comparisons (DCP under torchrun 4, mx under mpirun 4) are in
``bench_checkpoint_mp.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def state(mib: int) -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(0)
    count = max(3, mib // 64)  # 64 MiB per float32 4096 x 4096 matrix
    out: dict[str, np.ndarray] = {}
    for i in range(count - 2):
        out[f"layers.{i}.w"] = rng.standard_normal((4096, 4096), dtype=np.float32)
        out[f"layers.{i}.b"] = rng.standard_normal(4096, dtype=np.float32)
    for i in range(2):
        out[f"bf16.{i}"] = out["layers.0.w"][i * 2048 : (i + 1) * 2048].astype(ml_dtypes.bfloat16)
    out["uneven"] = rng.standard_normal((4097, 4096), dtype=np.float32)
    return out


def _drop_cache(paths: list[Path]) -> None:
    """Evict the files from the page cache (posix_fadvise DONTNEED after a sync)."""
    os.sync()
    for path in paths:
        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cold(trial: Any, paths: list[Path], trials: int = 3) -> float:
    """The median of ``trials`` runs of ``trial()`` (which returns its seconds), each after
    the files at ``paths`` are dropped from the page cache: one cold read's time moves by 2x
    and more on this project's virtual disk."""
    times = []
    for _ in range(trials):
        _drop_cache(paths)
        times.append(trial())
    return statistics.median(times)


def best_save(fn: Any, place: Path, trials: int = 3) -> float:
    """The best of ``trials`` saves to ``place``, each after an ``os.sync`` (no save pays
    for an earlier write's writeback) and with the previous one removed (a job keeping its
    latest checkpoint), as :func:`limits` takes the best of three writes: one write's time
    moves by 2x and more on this project's virtual disk."""
    best = math.inf
    for _ in range(trials):
        shutil.rmtree(place, ignore_errors=True)
        os.sync()
        best = min(best, timed(fn))
    return best


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def limits(
    work: Path,
    nbytes: int,
    timer: Any = timed,
    name: str = "limit.bin",
    memcpy: bool = True,
    written: int | None = None,
) -> dict[str, float]:
    """Seconds for this machine's floor on ``nbytes``: pwrite + fsync, pread warm (into a
    reused buffer and into new memory) and cold, and memcpy, in 64 MiB pieces, each timed by
    ``timer`` (bench_checkpoint_mp's times every process at once, on a file of its own).
    ``written``: the bytes the write floor writes, where a save writes fewer than a load
    reads (a replicated block is saved once, loaded by every process that holds it)."""
    piece = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)
    path = work / name

    def write(size: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            at = 0
            while at < size:
                n = min(len(piece), size - at)
                os.pwrite(fd, piece[:n].data, at)
                at += n
            os.fsync(fd)
        finally:
            os.close(fd)

    buf = bytearray(64 << 20)

    def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            while at < nbytes:
                got = os.preadv(fd, [memoryview(buf)[: min(len(buf), nbytes - at)]], at)
                at += got
        finally:
            os.close(fd)

    def read_new() -> None:  # into new memory, as a load's destination arrays are
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            while at < nbytes:
                out = np.empty(min(64 << 20, nbytes - at), dtype=np.uint8)
                at += os.preadv(fd, [out], at)
        finally:
            os.close(fd)

    # the best of three: one write's time on this disk moves 0.1-0.7 s for 224 MiB (dirty
    # pages throttled, a truncated file's blocks discarded), and a floor is the best it does
    wbytes = nbytes if written is None else written
    out = {"pwrite+fsync": min(timer(lambda: write(wbytes)) for _ in range(3))}
    if wbytes != nbytes:
        write(nbytes)  # what the reads read
    timer(read)
    out["pread warm"] = min(timer(read) for _ in range(2))
    out["pread warm, into new memory"] = min(timer(read_new) for _ in range(2))
    out["pread cold"] = cold(lambda: timer(read), [path])
    path.unlink()
    if memcpy:
        src = np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        out["memcpy"] = min(timer(lambda: np.copyto(dst, src)) for _ in range(3))
    return out


def _status(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status")


def peak(path: str, backend: str) -> None:
    """In a fresh process: the peak resident memory of one load of the checkpoint at ``path``
    (its saved layout, 8 JAX devices; or numpy leaves for ``backend`` numpy) beyond the
    arrays it returns, printed as JSON with the checkpoint's largest contiguous run."""
    import unimesh
    from unimesh import Layout, Mesh, P

    ck = unimesh.open_checkpoint(path)
    largest = max(b.end - b.start for name in ck.names for b in ck.tensor(name).boxes)
    if backend == "numpy":
        from unimesh.checkpoint.format import numpy_dtype

        target: dict[str, Any] = {  # untouched: np.empty's pages are not resident
            n: np.empty(ck.tensor(n).shape, numpy_dtype(ck.tensor(n).dtype)) for n in ck.names
        }
    else:
        import jax

        jax.devices()  # the runtime's own memory before the baseline
        mesh = Mesh.from_string("x=4,y=2")
        target = {}
        for name in ck.names:
            t = ck.tensor(name)
            spec = P("x", "y") if len(t.shape) == 2 and t.shape[0] % 4 == 0 else (
                P(None, "y") if len(t.shape) == 2 else P())  # fmt: skip
            target[name] = Layout(mesh, spec)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    got = unimesh.load(path, target, backend=None if backend == "numpy" else backend)
    if backend != "numpy":
        import jax

        jax.block_until_ready(got)
        buffers = {s.data.unsafe_buffer_pointer(): s.data.nbytes
                   for a in got.values() for s in a.addressable_shards}  # fmt: skip
        held = sum(buffers.values())  # replicas may share one host buffer on CPU
    else:
        held = sum(a.nbytes for a in got.values())
    high = _status("VmHWM")
    print(json.dumps({"peak beyond destination": high - before - held, "destination": held,
                      "largest run": largest}))  # fmt: skip


def s3_rows(arrays: dict[str, Any], target: dict[str, Any], row: Any) -> None:
    """The same save and load through fsspec to an S3 endpoint on 127.0.0.1 (moto's server,
    a process of its own, as the tests use): the figure beside the local-disk one. Needs
    s3fs and moto[server] (the test extra)."""
    import importlib.util
    import socket
    import subprocess
    import urllib.request

    import jax

    import unimesh

    if not all(importlib.util.find_spec(m) for m in ("s3fs", "moto")):
        print("BENCH s3: not run (needs s3fs and moto[server])", flush=True)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    os.environ.update(dict(zip(keys, ("bench", "bench", "us-east-1"))))
    os.environ["FSSPEC_S3_ENDPOINT_URL"] = endpoint
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                request = urllib.request.Request(endpoint + "/bench", method="PUT")
                urllib.request.urlopen(request, timeout=5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        url = "s3://bench/ckpt"
        row("unimesh s3", "save (moto S3 on 127.0.0.1)", timed(lambda: unimesh.save(url, arrays)),
            "")  # fmt: skip
        stats: dict[str, int] = {}
        load = lambda: jax.block_until_ready(  # noqa: E731
            unimesh.load(url, target, backend="jax", stats=stats)
        )
        load()
        row("unimesh s3", "load, same layout (ranged GETs)", min(timed(load) for _ in range(2)),
            "", read=stats["bytes_read"], held=stats["bytes_held"])  # fmt: skip
    finally:
        server.kill()
        server.wait()


def _peak_row(path: Path, backend: str) -> dict[str, Any]:
    import subprocess

    out = subprocess.run(
        [sys.executable, __file__, "--peak", str(path), "--peak-backend", backend],
        capture_output=True, text=True, check=True, timeout=1200,
    ).stdout  # fmt: skip
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the rows here as JSON")
    parser.add_argument("--skip", default="", help="systems to leave out: dcp,orbax,safetensors,s3")
    parser.add_argument("--peak", help=argparse.SUPPRESS)
    parser.add_argument("--peak-backend", default="jax", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        peak(args.peak, args.peak_backend)
        return
    import jax

    import unimesh
    from unimesh import Layout, Mesh, P

    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    skip = set(filter(None, args.skip.split(",")))
    rows: list[dict[str, Any]] = []
    try:
        values = state(args.mib)
        nbytes = sum(v.nbytes for v in values.values())
        mesh = Mesh.from_string("x=4,y=2")
        specs = {k: P("x", "y") if v.ndim == 2 and v.shape[0] % 4 == 0 else
                 (P(None, "y") if v.ndim == 2 else P()) for k, v in values.items()}  # fmt: skip
        arrays = {
            k: jax.device_put(v, unimesh.to_native(Layout(mesh, specs[k]), "jax"))
            for k, v in values.items()
        }
        jax.block_until_ready(arrays)
        floor = limits(work, nbytes)

        def row(system: str, operation: str, seconds: float, limit: str, **extra: Any) -> None:
            gbs = nbytes / seconds / 1e9
            frac = floor[limit] / seconds if limit else None
            if limit == "pread warm":  # a load's arrays are new memory: that floor too
                extra["of pread into new memory"] = round(
                    floor["pread warm, into new memory"] / seconds, 2)  # fmt: skip
            rows.append({"system": system, "operation": operation,
                         "seconds": round(seconds, 3), "GB/s": round(gbs, 2), "limit": limit,
                         "of limit": None if frac is None else round(frac, 2),
                         **extra})  # fmt: skip
            shown = "" if frac is None else f"{frac:.2f} of {limit}"
            if "of pread into new memory" in extra:
                shown += f", {extra['of pread into new memory']:.2f} of pread into new memory"
            print(f"BENCH {system:12s} {operation:28s} {seconds:8.3f} s {gbs:6.2f} GB/s {shown}",
                  flush=True)  # fmt: skip

        for name, seconds in floor.items():
            row("limit", name, seconds, "")
        # -- unimesh ------------------------------------------------------------------------
        path = work / "unimesh"
        row("unimesh", "save (durable: fsync)", best_save(lambda: unimesh.save(path, arrays),
            path), "pwrite+fsync")  # fmt: skip
        target = {k: Layout(mesh, specs[k]) for k in values}
        stats: dict[str, int] = {}
        load = lambda t: jax.block_until_ready(  # noqa: E731
            unimesh.load(path, t, backend="jax", stats=stats)
        )
        load(target)
        row("unimesh", "load warm, same layout", min(timed(lambda: load(target))
                                                     for _ in range(2)), "pread warm",
            read=stats["bytes_read"], held=stats["bytes_held"])  # fmt: skip
        row("unimesh", "load cold, same layout", cold(lambda: timed(lambda: load(target)),
                                                      [path]), "pread cold")  # fmt: skip
        other = Mesh.from_string("all=8")
        rows_target = {k: Layout(other, P("all") if v.shape and v.shape[0] % 8 == 0 else P())
                       for k, v in values.items()}  # fmt: skip
        row("unimesh", "load warm, reshard (rows)", min(timed(lambda: load(rows_target))
                                                        for _ in range(2)), "pread warm",
            read=stats["bytes_read"], held=stats["bytes_held"])  # fmt: skip
        # onto columns: each block's rows are short runs at one stride in the saved boxes
        cols_target = {k: Layout(other, P(None, "all") if v.ndim == 2 and v.shape[1] % 8 == 0
                                 else P()) for k, v in values.items()}  # fmt: skip
        row("unimesh", "load warm, reshard (columns)", min(timed(lambda: load(cols_target))
                                                           for _ in range(2)), "pread warm",
            read=stats["bytes_read"], held=stats["bytes_held"])  # fmt: skip
        row("unimesh", "load cold, reshard (columns)", cold(lambda: timed(lambda: load(
            cols_target)), [path]), "pread cold", read=stats["bytes_read"],
            held=stats["bytes_held"])  # fmt: skip
        for kind in ("jax", "numpy"):  # peak memory of a load, in a fresh process
            found = _peak_row(path, kind)
            mib = {k: round(v / 2**20, 1) for k, v in found.items()}
            rows.append({"system": "unimesh", "operation": f"load peak memory ({kind})",
                         **{f"{k} (MiB)": v for k, v in mib.items()}})  # fmt: skip
            print(f"BENCH unimesh      load peak memory ({kind}): {mib['peak beyond destination']}"
                  f" MiB beyond the {mib['destination']} MiB destination (largest contiguous "
                  f"run {mib['largest run']} MiB)", flush=True)  # fmt: skip

        # async_save's floor: a copy of each block into new host memory, kept (as a snapshot
        # must keep it); timed alternately with async_save (each written out before the next)
        views = [  # each distinct block once, as a save writes it
            v for a in arrays.values()
            for v in {str(s.index): np.asarray(s.data) for s in a.addressable_shards}.values()
        ]  # fmt: skip

        def host_copy() -> None:
            kept = [v.copy() for v in views]
            del kept

        copies, tries, handle = [], [], []
        for _ in range(3):
            copies.append(timed(host_copy))
            tries.append(timed(lambda: handle.append(unimesh.async_save(work / "async",
                                                                        arrays))))  # fmt: skip
            handle.pop().wait()
        copy, blocking = min(copies), min(tries)
        row("host copy", "every block to new host memory", copy, "memcpy")
        row("unimesh", "async_save blocking", blocking, "", **{"x host copy": round(
            blocking / copy, 2)})  # fmt: skip
        shutil.rmtree(work / "async", ignore_errors=True)
        # -- object storage -----------------------------------------------------------------
        if "s3" not in skip:
            s3_rows(arrays, target, row)
        # -- safetensors --------------------------------------------------------------------
        if "safetensors" not in skip:
            from safetensors import safe_open
            from safetensors.numpy import save_file

            file = work / "model.safetensors"
            row("safetensors", "save_file (whole arrays)", timed(lambda: save_file(
                values, str(file))), "pwrite+fsync")  # fmt: skip

            def sliced() -> None:
                with safe_open(str(file), framework="numpy") as f:
                    for k, v in values.items():
                        layout = Layout(mesh, specs[k])
                        seen = set()
                        for sl in layout.device_slices(v.shape).values():
                            key = tuple((s.start, s.stop) for s in sl)
                            if key not in seen:
                                seen.add(key)
                                f.get_slice(k)[sl]

            sliced()
            best = min(timed(sliced) for _ in range(2))
            row("safetensors", "get_slice warm, same blocks", best, "pread warm")
        # -- torch DCP (one process) --------------------------------------------------------
        if "dcp" not in skip:
            import warnings

            import torch
            import torch.distributed.checkpoint as dcp
            from unimesh_torch.translate import from_host

            tensors = {k: from_host(v) for k, v in values.items()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row("torch DCP", "dcp.save (one process)", best_save(lambda: dcp.save(
                    tensors, checkpoint_id=str(work / "dcp")), work / "dcp"),
                    "pwrite+fsync")  # fmt: skip
                into = {k: torch.empty_like(t) for k, t in tensors.items()}
                dcp.load(into, checkpoint_id=str(work / "dcp"))
                best = min(
                    timed(lambda: dcp.load(into, checkpoint_id=str(work / "dcp"))) for _ in "ab"
                )
                row("torch DCP", "dcp.load warm (one process)", best, "pread warm")
            del tensors, into
            ours = unimesh.open_checkpoint(work / "dcp")  # DCP's own files, read by unimesh
            row("unimesh", "load warm, from DCP files", min(timed(lambda: jax.block_until_ready(
                unimesh.load(work / "dcp", target, backend="jax"))) for _ in range(2)),
                "pread warm", tensors=len(ours.names))  # fmt: skip
        # -- Orbax --------------------------------------------------------------------------
        if "orbax" not in skip:
            import orbax.checkpoint as ocp

            checkpointer = ocp.StandardCheckpointer()

            def orbax_save() -> None:
                checkpointer.save(work / "orbax", arrays)
                checkpointer.wait_until_finished()

            row("Orbax", "StandardCheckpointer.save", best_save(orbax_save, work / "orbax"),
                "pwrite+fsync")  # fmt: skip
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, arrays)
            restore = lambda: jax.block_until_ready(  # noqa: E731
                checkpointer.restore(work / "orbax", abstract)
            )
            restore()
            row("Orbax", "restore warm, same layout", min(timed(restore) for _ in range(2)),
                "pread warm")  # fmt: skip
            row("unimesh", "load warm, from Orbax files", min(timed(lambda: jax.block_until_ready(
                unimesh.load(work / "orbax", target, backend="jax"))) for _ in range(2)),
                "pread warm")  # fmt: skip
            columns = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=unimesh.to_native(
                cols_target[k], "jax")) for k, v in values.items()}  # fmt: skip
            row("Orbax", "restore cold, reshard (columns)", cold(lambda: timed(
                lambda: jax.block_until_ready(checkpointer.restore(work / "orbax", columns))),
                [work / "orbax"]), "pread cold")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"state: {nbytes / 2**20:.0f} MiB in {len(values)} tensors, 8 JAX CPU devices, one "
          "process")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"mib": args.mib, "bytes": nbytes, "rows": rows},
                                              indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
