"""Orbax checkpoints in (issue 36, item 4): what Orbax's own StandardCheckpointer saves from 8
JAX devices loads on torch under torchrun 4, on MLX under mpirun 4 and on JAX (torch
unimportable there), each onto another mesh: every block bit-exact, each process reading only
the saved chunks its blocks touch (through TensorStore, as Orbax itself reads). Hostile
``_METADATA`` and zarr metadata are refused with CheckpointError before TensorStore opens
anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import unimesh
from unimesh import CheckpointError

from .support.launch import WORKERS, need, worker_output

WORKER = WORKERS / "orbax_worker.py"
LIMIT = 300
RANKS = {"jax": 1, "torch": 4, "mlx": 4}
SAVED = "UNIMESH_TEST_ORBAX_SAVED"
# Orbax and TensorStore leave threads and native state behind: every test here runs in a child
pytestmark = pytest.mark.isolated


def _launch(framework: str, *args: str) -> str:
    return worker_output(WORKER, framework, list(args), LIMIT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Orbax's own save, once (a worker process); the isolated tests' child processes are
    handed its folder through the environment instead of saving again."""
    need("jax", "orbax.checkpoint", "tensorstore")
    given = os.environ.get(SAVED)
    if given:
        yield Path(given)
        return
    out = tmp_path_factory.mktemp("orbax")
    _launch("jax", "save", str(out))
    os.environ[SAVED] = str(out)
    try:
        yield out
    finally:
        os.environ.pop(SAVED, None)


@pytest.mark.timeout(3 * LIMIT)
@pytest.mark.parametrize("loader", ["jax", "torch", "mlx"])
def test_an_orbax_checkpoint_loads_on(saved: Path, loader: str) -> None:
    pytest.importorskip({"jax": "jax", "torch": "torch", "mlx": "mlx.core"}[loader])
    output = _launch(loader, "load", loader, str(saved))
    for rank in range(RANKS[loader]):
        path = saved / f"load-{loader}-rank-{rank}.json"
        assert path.exists(), output[-4000:]
        report = json.loads(path.read_text())
        assert not report["errors"], f"{loader} rank {rank}: {report['errors']}"
        assert report["kind"] == "orbax"
        assert report["read"] <= report["chunks"], report  # only the chunks its blocks touch
        if RANKS[loader] > 1:
            assert report["read"] < report["total"], report  # not the whole checkpoint
        if loader != "torch":
            assert report["torch_imported"] is False


def test_orbax_metadata_is_shown_and_verified(saved: Path) -> None:
    ck = unimesh.open_checkpoint(saved / "orbax")
    assert ck.kind == "orbax"
    assert sorted(ck.names) == sorted(
        ["params.w", "params.bf", "params.n", "params.r", "opt.m", "step"]
    )
    assert ck.tensor("params.w").shape == (8, 12)
    assert ck.tensor("params.bf").dtype == "bfloat16"
    assert len(ck.tensor("params.w").boxes) == 8  # one chunk per saved shard (4 x 2)
    from unimesh.cli import main

    assert main(["checkpoint", "verify", str(saved / "orbax")]) == 0


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(saved / "orbax", tmp_path / "o")
    return tmp_path / "o"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"\xff\xfe", "not UTF-8"),
        (b"[1, 2]", "tree_metadata"),
        (b'{"tree_metadata": {"a": {"key_metadata": [{"key": ""}], "value_metadata": {}}}}',
         "bad keys"),
        (b'{"tree_metadata": {"a": 1}}', "lacks key or value"),
        (b'{"tree_metadata": {}, "tree_metadata": {}}', "duplicate key"),
    ],
)  # fmt: skip
def test_a_bad_orbax_metadata_is_refused(
    saved: Path, tmp_path: Path, text: bytes, message: str
) -> None:
    root = _copy(saved, tmp_path)
    (root / "_METADATA").write_bytes(text)
    with pytest.raises(CheckpointError, match=message):
        unimesh.open_checkpoint(root)


@pytest.mark.parametrize(
    ("zarray", "message"),
    [
        ({"shape": [2**61, 2**61], "chunks": [1, 1], "dtype": "<f4"}, "do not fit|too many"),
        ({"shape": [8, 12], "chunks": [0, 6], "dtype": "<f4"}, "chunks"),
        ({"shape": [8, 12], "chunks": [2, 6], "dtype": "|O"}, "dtype"),
        ({"shape": [8, 12], "chunks": [2, 6], "dtype": ">f4"}, "dtype"),
        ({"shape": "8", "chunks": [2, 6], "dtype": "<f4"}, "shape"),
        ({"shape": [8, 12, 1], "chunks": [2, 6], "dtype": "<f4"}, "do not fit"),
    ],
)
def test_bad_zarr_metadata_is_refused_before_tensorstore_opens_it(
    saved: Path, tmp_path: Path, zarray: dict[str, object], message: str
) -> None:
    import tensorstore as ts

    root = _copy(saved, tmp_path)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": root.resolve().as_uri() + "/"}).result()
    meta = json.loads(bytes(kv.read("params.w/.zarray").result().value))
    meta.update(zarray)
    kv.write("params.w/.zarray", json.dumps(meta).encode()).result()
    del kv
    with pytest.raises(CheckpointError, match=message):
        unimesh.open_checkpoint(root)


def test_without_tensorstore_the_error_names_the_extra(saved: Path) -> None:
    code = (
        "import sys; sys.modules['tensorstore'] = None\n"
        "import unimesh\n"
        "try:\n    unimesh.open_checkpoint(sys.argv[1])\n"
        "except unimesh.CheckpointError as exc:\n    print('REFUSED', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(saved / "orbax")],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert "REFUSED" in out.stdout and "unimesh[orbax]" in out.stdout, out.stdout + out.stderr


def test_orbax_own_safetensors_loader_reads_what_convert_writes(tmp_path: Path) -> None:
    """Issue 36, item 3: Orbax's safetensors layout (orbax.checkpoint.v1) reads
    ``unimesh checkpoint convert --to safetensors`` output as it is, sharded with an index."""
    import warnings

    import numpy as np

    pytest.importorskip("jax")
    pytest.importorskip("orbax.checkpoint")
    import ml_dtypes
    from orbax.checkpoint import v1 as ocp

    from unimesh.checkpoint import to_safetensors

    rng = np.random.default_rng(3)
    tree = {
        "a": {
            "w": rng.standard_normal((64, 48)).astype(np.float32),
            "bf": rng.standard_normal((40,)).astype(ml_dtypes.bfloat16),
        },
        "n": np.arange(-8, 8, dtype=np.int32),
    }
    unimesh.save(tmp_path / "u", tree)
    to_safetensors(tmp_path / "u", tmp_path / "hf", max_shard_bytes=8 << 10)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ocp.Context(checkpoint_layout=ocp.options.CheckpointLayout.SAFETENSORS):
            got = ocp.load(str(tmp_path / "hf"))
    assert sorted(got) == ["a.bf", "a.w", "n"]
    for name, want in (("a.w", tree["a"]["w"]), ("a.bf", tree["a"]["bf"]), ("n", tree["n"])):
        value = np.asarray(got[name])
        assert value.dtype == want.dtype and value.tobytes() == want.tobytes(), name
