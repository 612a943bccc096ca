"""Checkpoints in object storage (issue 37, item 4), against an S3 endpoint this test starts on
127.0.0.1 (moto's server, as s3fs's own tests use): a 4-process save under torchrun and under
mpirun to ``s3://``, each loaded onto JAX with another mesh (ranged reads: each block's byte
runs, counted at the filesystem layer), a save killed between its data files and its manifest
(the previous checkpoint stays whole; the next save removes the leftovers), and the command
line on a URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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
    counted at the filesystem layer); DCP and Orbax checkpoints there are refused naming the
    fix."""
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
    with pytest.raises(CheckpointError, match="copy torch DCP and Orbax checkpoints locally"):
        unimesh.open_checkpoint("s3://ckpts/dcp")
