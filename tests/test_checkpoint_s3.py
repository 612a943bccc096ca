"""Checkpoints in object storage (issue 37, item 4), against an S3 endpoint this test starts on
127.0.0.1 (moto's server, as s3fs's own tests use): a 4-process save under torchrun and under
mpirun to ``s3://``, each loaded onto JAX with another mesh (ranged reads: each block's byte
runs, counted at the filesystem layer), a save killed between its data files and its manifest
(the previous checkpoint stays whole; the next save removes the leftovers), the command
line on a URL, and the formats people already have (issue 69, item 5): Hugging Face
safetensors, torch DCP directories, HuggingFaceStorageWriter's shards and Orbax checkpoints in
a bucket load as the same local directory does, and the Hugging Face export writes into
one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import unimesh
from unimesh import CheckpointError

from .support.launch import WORKERS, free_port, kill_tree, need, run_worker

SUPPORT = Path(__file__).parent / "support"
WORKER = WORKERS / "s3_worker.py"
LIMIT = 300
ENDPOINT = "FSSPEC_S3_ENDPOINT_URL"


# fsspec's IO loop thread lives as long as its process: every test here runs in a child
pytestmark = pytest.mark.isolated


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """moto's S3 server (its own process) on a free port, with the bucket ``ckpts``; the
    environment that points fsspec (s3fs) at it, which the isolated tests' children inherit."""
    need("s3fs", "moto.server")
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", ENDPOINT)
    if os.environ.get(ENDPOINT):  # a child: the parent's server
        yield {k: os.environ[k] for k in keys}
        return
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    env = dict(zip(keys, ("testing", "testing", "us-east-1", f"http://127.0.0.1:{port}")))
    saved = {k: os.environ.get(k) for k in env}
    try:
        _make_bucket(env[ENDPOINT] + "/ckpts", server)
        os.environ.update(env)
        yield env
    finally:
        kill_tree(server.pid)
        server.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _make_bucket(url: str, server: subprocess.Popen[bytes]) -> None:
    """PUT the bucket once the server answers (moto checks no signature)."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=5).close()
            return
        except (urllib.error.URLError, ConnectionError) as exc:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"moto's S3 server did not come up at {url}: {exc}")
            time.sleep(0.2)


def _launch(s3: dict[str, str], framework: str, *args: str) -> tuple[int, str]:
    return run_worker(WORKER, framework, list(args), LIMIT, **s3)


@pytest.mark.timeout(4 * LIMIT)
@pytest.mark.parametrize("saver", ["torch", "mlx"])
def test_a_four_process_save_to_s3_loads_onto_jax(
    s3: dict[str, str], tmp_path: Path, saver: str
) -> None:
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core"}[saver])
    pytest.importorskip("jax")
    pytest.importorskip("ml_dtypes")
    url = f"s3://ckpts/{saver}"
    rc, output = _launch(s3, saver, "save", saver, url, str(tmp_path))
    assert rc == 0, output[-6000:]
    ck = unimesh.open_checkpoint(url)
    assert ck.kind == "unimesh" and len(ck.names) == 7
    files = {b.file for t in ck.tensors.values() for b in t.boxes}
    assert len(files) == 4  # one object per process
    rc, output = _launch(s3, "jax", "load", "jax", url, str(tmp_path))
    assert rc == 0, output[-6000:]
    report = json.loads((tmp_path / f"load-{saver}.json").read_text())
    assert not report["errors"], report["errors"]
    assert report["read"] <= 1.05 * report["held"], report
    assert report["slice_read"] == 2 * 12 * 4  # two float32 rows of model.w, nothing more
    # at the filesystem layer: the blocks' bytes, the manifest and the data files' headers
    assert report["fetched"] <= report["slice_read"] + report["manifest"] + 4 * 4096, report


def test_a_save_killed_before_its_manifest_leaves_the_previous_checkpoint(
    s3: dict[str, str], tmp_path: Path
) -> None:
    pytest.importorskip("ml_dtypes")
    sys.path.insert(0, str(SUPPORT))
    try:
        from checkpoint_matrix import data
    finally:
        sys.path.remove(str(SUPPORT))
    import fsspec

    url = "s3://ckpts/killed"
    first = {name: value for name, value in data().items() if value.dtype.kind == "f"}
    unimesh.save(url, {"model": first})
    rc, output = _launch(s3, "numpy", "killed", "none", url, str(tmp_path))
    assert rc == 9, output[-3000:]
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpts/killed", detail=False))
    assert len([n for n in names if n.startswith("data-")]) == 2, names  # the dead save's too
    ck = unimesh.open_checkpoint(url)  # still the first save, whole
    for name, value in first.items():
        assert ck.read(f"model.{name}").tobytes() == value.tobytes()
    second = {name: value * 2 for name, value in first.items()}
    unimesh.save(url, {"model": second})
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpts/killed", detail=False))
    assert len(names) == 2 and "manifest.json" in names, names  # leftovers removed
    ck = unimesh.open_checkpoint(url, verify=True)
    for name, value in second.items():
        assert ck.read(f"model.{name}").tobytes() == value.tobytes()


def test_the_command_line_and_errors_on_urls(
    s3: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from unimesh.cli import main

    url = "s3://ckpts/cli"
    unimesh.save(url, {"a": np.arange(6.0).reshape(2, 3)})
    assert main(["checkpoint", "verify", url]) == 0
    assert "sound (1 tensors" in capsys.readouterr().out
    assert main(["checkpoint", "show", "--json", url]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"]["a"]["shape"] == [2, 3]
    with pytest.raises(CheckpointError, match="no manifest.json"):
        unimesh.open_checkpoint("s3://ckpts/nothing-here")
    with pytest.raises(CheckpointError, match="nosuchscheme"):
        unimesh.open_checkpoint("nosuchscheme://x/y")
    got = unimesh.load(url, {"a": np.zeros((2, 3))})  # a numpy target: read whole
    assert got["a"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_hugging_face_safetensors_in_a_bucket_are_read_by_ranges(s3: dict[str, str]) -> None:
    """A Hugging Face model in object storage, sharded with its index and as one file, opens
    and loads from the URL: the index and headers first, then each slice's byte runs (read
    counted at the filesystem layer); damaged DCP and Orbax metadata there are refused as
    local ones are."""
    import fsspec
    from safetensors.numpy import save

    rng = np.random.default_rng(3)
    weights = {
        "embed.weight": rng.standard_normal((64, 16)).astype(np.float32),
        "layer.0.w": rng.standard_normal((16, 32)).astype(np.float32),
        "layer.0.b": np.arange(32, dtype=np.int64),
    }
    fs = fsspec.filesystem("s3")
    shards = {"model-00001-of-00002.safetensors": ["embed.weight"]}
    shards["model-00002-of-00002.safetensors"] = ["layer.0.w", "layer.0.b"]
    for file, names in shards.items():
        fs.pipe_file(f"ckpts/hf/{file}", save({n: weights[n] for n in names}))
    index = {"weight_map": {n: f for f, names in shards.items() for n in names}}
    fs.pipe_file("ckpts/hf/model.safetensors.index.json", json.dumps(index).encode())
    fs.pipe_file("ckpts/single/model.safetensors", save(weights))

    for url in ("s3://ckpts/hf", "s3://ckpts/single", "s3://ckpts/single/model.safetensors"):
        ck = unimesh.open_checkpoint(url)
        assert ck.kind == "safetensors" and sorted(ck.names) == sorted(weights), url
        headers = ck.storage.bytes_read
        part = ck.read("embed.weight", (slice(8, 12), slice(0, 16)))
        assert part.tobytes() == weights["embed.weight"][8:12].tobytes(), url
        assert ck.storage.bytes_read - headers == 4 * 16 * 4, url  # the 4 rows, nothing more
        for name, value in weights.items():
            assert ck.read(name).tobytes() == value.tobytes(), (url, name)
    got = unimesh.load("s3://ckpts/hf", {n: np.zeros_like(v) for n, v in weights.items()})
    assert all(got[n].tobytes() == v.tobytes() for n, v in weights.items())

    bad = {"weight_map": {"x": "../hf/model-00001-of-00002.safetensors"}}
    fs.pipe_file("ckpts/badindex/model.safetensors.index.json", json.dumps(bad).encode())
    with pytest.raises(CheckpointError, match=r"\.\."):
        unimesh.open_checkpoint("s3://ckpts/badindex")
    fs.pipe_file("ckpts/missing/model.safetensors.index.json", json.dumps(index).encode())
    with pytest.raises(CheckpointError, match="which is missing"):
        unimesh.open_checkpoint("s3://ckpts/missing")
    fs.pipe_file("ckpts/dcp/.metadata", b"\x80\x04N.")
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata is not DCP metadata"):
        unimesh.open_checkpoint("s3://ckpts/dcp")
    fs.pipe_file("ckpts/orbax/_METADATA", b"{}")
    with pytest.raises(CheckpointError, match=r"orbax/_METADATA has no 'tree_metadata'"):
        unimesh.open_checkpoint("s3://ckpts/orbax")


def _upload(local: Path, prefix: str) -> str:
    """Every file of the directory ``local`` put under ``ckpts/prefix``; the URL."""
    import fsspec

    fs = fsspec.filesystem("s3")
    for path in sorted(local.iterdir()):
        fs.put_file(str(path), f"ckpts/{prefix}/{path.name}")
    fs.invalidate_cache()
    return f"s3://ckpts/{prefix}"


def _same_as_local(url: str, local: Path, saved: dict[str, np.ndarray], kind: str) -> None:
    """The checkpoint at ``url`` opens as the local copy does (its kind, names, shapes and
    dtypes), every tensor reads back as saved, a slice reads only its byte runs, and a load
    from the URL gives what the load from the directory gives."""
    there, here = unimesh.open_checkpoint(url), unimesh.open_checkpoint(local)
    assert there.kind == here.kind == kind, (there.kind, here.kind)
    assert sorted(there.names) == sorted(here.names) == sorted(saved)
    for name, value in saved.items():
        t, h = there.tensor(name), here.tensor(name)
        assert (t.shape, t.dtype) == (h.shape, h.dtype) == (value.shape, str(value.dtype)), name
        got = there.read(name)
        assert got.tobytes() == here.read(name).tobytes() == value.tobytes(), name
    rows = next(n for n, v in saved.items() if v.ndim == 2 and v.flags.c_contiguous)
    before = there.storage.bytes_read
    part = there.read(rows, (slice(1, 2), slice(None)))
    assert part.tobytes() == saved[rows][1:2].tobytes()
    if there.reads_boxes:  # not Orbax's, whose chunks TensorStore reads from the store
        assert there.storage.bytes_read - before == saved[rows][1:2].nbytes  # that row only
    target = {name: np.zeros_like(value) for name, value in saved.items()}
    remote, from_disk = unimesh.load(url, target), unimesh.load(local, target)
    for name, value in saved.items():
        assert remote[name].tobytes() == from_disk[name].tobytes() == value.tobytes(), name


def test_torch_dcp_and_hugging_face_shards_in_a_bucket_load_as_local_ones(
    s3: dict[str, str], tmp_path: Path
) -> None:
    """A torch DCP directory (a transposed tensor among its chunks) and the files of torch's
    HuggingFaceStorageWriter(save_distributed=True), put in the bucket file by file, open and
    load from the URL as from the local directory: every byte through the Storage, slices by
    ranged reads."""
    import warnings

    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    state = {
        "w": torch.arange(24.0).reshape(4, 6),
        "t": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),  # a strided chunk
        "b": torch.tensor([True, False, True]),
        "e": torch.arange(8, dtype=torch.int64).reshape(2, 4),
    }
    saved = {name: value.contiguous().numpy() for name, value in state.items()}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
        writer = dcp.HuggingFaceStorageWriter(str(tmp_path / "hf"), save_distributed=True)
        dcp.save({k: v.contiguous() for k, v in state.items()}, storage_writer=writer)
    assert any(p.suffix == ".distcp" for p in (tmp_path / "dcp").iterdir())
    url = _upload(tmp_path / "dcp", "dcp-dir")
    assert unimesh.open_checkpoint(url).tensor("t").boxes[0].strides  # read whole, then viewed
    _same_as_local(url, tmp_path / "dcp", saved, "dcp")
    assert [p.suffix for p in (tmp_path / "hf").iterdir()] == [".safetensors"]
    _same_as_local(_upload(tmp_path / "hf", "hf-shards"), tmp_path / "hf", saved, "safetensors")


def test_an_orbax_checkpoint_in_a_bucket_loads_as_a_local_one(
    s3: dict[str, str], tmp_path: Path
) -> None:
    """Orbax's own saves (OCDBT, its default, and plain zarr files) put in the bucket:
    ``_METADATA`` read through the Storage, the arrays by TensorStore's S3 driver at fsspec's
    endpoint (the chunks are compressed, OCDBT's B-tree over them: TensorStore's to read),
    giving what the local directory gives; a URL TensorStore cannot reach (fsspec's
    memory://) is refused naming the fix."""
    pytest.importorskip("jax")
    pytest.importorskip("tensorstore")
    ocp = pytest.importorskip("orbax.checkpoint")
    import fsspec

    rng = np.random.default_rng(7)
    saved = {
        "w": rng.standard_normal((8, 12)).astype(np.float32),
        "b": np.arange(6, dtype=np.int32),
    }
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "orbax", saved)
    checkpointer.wait_until_finished()
    checkpointer.close()
    plain = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))  # zarr files
    plain.save(tmp_path / "plain", saved)
    plain.close()
    fs = fsspec.filesystem("s3")
    for name in ("orbax", "plain"):
        fs.put(f"{tmp_path / name}/", f"ckpts/{name}-dir/", recursive=True)
        fs.invalidate_cache()
        _same_as_local(f"s3://ckpts/{name}-dir", tmp_path / name, saved, "orbax")
    memory = fsspec.filesystem("memory")
    memory.pipe_file("/orbax/_METADATA", (tmp_path / "orbax" / "_METADATA").read_bytes())
    with pytest.raises(CheckpointError, match="TensorStore reaches local paths, s3:// and gs://"):
        unimesh.open_checkpoint("memory://orbax")


def test_a_checkpoint_converts_to_hugging_face_safetensors_in_a_bucket(
    s3: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The export writes through the Storage too: into an s3:// place, sharded with its
    index, read back from there as the local export is; ``convert`` to a URL alike."""
    from unimesh.cli import main

    rng = np.random.default_rng(5)
    saved = {
        "a": rng.standard_normal((16, 8)).astype(np.float32),
        "b": np.arange(40, dtype=np.int64).reshape(5, 8),
    }
    unimesh.save(tmp_path / "ck", saved)
    steps: list[tuple[int, int]] = []
    kw: dict[str, Any] = {"max_shard_bytes": 256, "window": 64}
    files = unimesh.checkpoint.to_safetensors(
        tmp_path / "ck", "s3://ckpts/export", progress=lambda d, t: steps.append((d, t)), **kw
    )
    assert files == unimesh.checkpoint.to_safetensors(tmp_path / "ck", tmp_path / "hf", **kw)
    assert files[-1] == "model.safetensors.index.json" and len(files) == 3
    assert steps[0] == (0, 832) and steps[-1] == (832, 832)
    _same_as_local("s3://ckpts/export", tmp_path / "hf", saved, "safetensors")
    with pytest.raises(CheckpointError, match="into its source"):
        unimesh.checkpoint.to_safetensors("s3://ckpts/export", "s3://ckpts/export/")
    cli = ["checkpoint", "convert", str(tmp_path / "ck"), "s3://ckpts/cli-export"]
    assert main([*cli, "--to", "safetensors", "--max-shard-size", "256"]) == 0
    assert "s3://ckpts/cli-export: 3 files" in capsys.readouterr().out
    _same_as_local("s3://ckpts/cli-export", tmp_path / "hf", saved, "safetensors")
