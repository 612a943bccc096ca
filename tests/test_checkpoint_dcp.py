"""torch Distributed Checkpoint in and out (issue 36, items 1 and 2).

In: checkpoints that torch's own ``dcp.save`` writes, from an FSDP2 x TP model
(``fully_shard`` over ``parallelize_module``: ``_StridedShard``) under torchrun 4, with the
default FileSystemWriter and with ``HuggingFaceStorageWriter(save_distributed=True)``, are
loaded on JAX (with torch unimportable), on torch under torchrun 4 and on MLX under mpirun 4,
each onto another mesh and layout: every block bit-exact against torch's own
``full_tensor()``, each process reading exactly its blocks' bytes. ``.metadata`` is read by a
restricted unpickler: a pickle that would call ``os.system`` is refused and nothing runs
(checked under an audit hook).

Out: ``dcp.load(state_dict, storage_reader=unimesh_torch.CheckpointReader(path))`` under
torchrun 4 loads a checkpoint unimesh saved from JAX into DTensors (FSDP-over-TP placements
among them), bit-exact."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import unimesh
from unimesh import CheckpointError

from .support.launch import WORKERS, worker_output

WORKER = WORKERS / "dcp_worker.py"
LIMIT = 300
RANKS = {"jax": 1, "torch": 4, "mlx": 4}


def _launch(framework: str, *args: str) -> str:
    return worker_output(WORKER, framework, list(args), LIMIT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    out = tmp_path_factory.mktemp("dcp")
    _launch("torch", "save", str(out))
    return out


@pytest.mark.timeout(3 * LIMIT)
def test_what_torch_saved_opens_without_torch_placements(saved: Path) -> None:
    """The save really is FSDP over TP (torch's _StridedShard), and both directories open."""
    placements = json.loads((saved / "placements.json").read_text())
    assert "_StridedShard" in placements["block.wq.weight"]
    ck = unimesh.open_checkpoint(saved / "dcp")
    assert ck.kind == "dcp"
    assert ck.objects == ["step"]
    with pytest.raises(CheckpointError, match="pickled object"):
        ck.read("step")
    assert len(ck.tensor("block.wq.weight").boxes) == 4  # four chunks, one per rank
    assert ck.tensor("extra.bf").dtype == "bfloat16"
    hf = unimesh.open_checkpoint(saved / "hf")
    assert sorted(hf.names) == sorted(ck.names)
    for name in ck.names:
        assert hf.tensor(name).shape == ck.tensor(name).shape
        np.testing.assert_array_equal(hf.read(name), ck.read(name))


@pytest.mark.timeout(3 * LIMIT)
@pytest.mark.parametrize("loader", ["jax", "torch", "mlx"])
def test_torch_dcp_loads_on(saved: Path, loader: str) -> None:
    pytest.importorskip({"jax": "jax", "torch": "torch", "mlx": "mlx.core"}[loader])
    pytest.importorskip("ml_dtypes")
    output = _launch(loader, "load", loader, str(saved))
    for rank in range(RANKS[loader]):
        path = saved / f"load-{loader}-rank-{rank}.json"
        assert path.exists(), output[-4000:]
        report = json.loads(path.read_text())
        for kind in ("dcp", "hf"):
            result = report[kind]
            assert not result["errors"], f"{kind} -> {loader} rank {rank}: {result['errors']}"
            assert result["tensors"] == 9
            assert result["read"] <= 1.05 * result["held"], (kind, loader, rank, result)
            if loader != "torch":
                assert result["torch_imported"] is False
        assert report["dcp"]["kind"] == "dcp"
        assert report["dcp"]["objects"] == ["step"]


@pytest.mark.timeout(3 * LIMIT)
def test_torch_dcp_load_reads_a_unimesh_checkpoint_saved_from_jax(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    _launch("jax", "jax-save", str(tmp_path))
    output = _launch("torch", "dcp-load", str(tmp_path))
    for rank in range(4):
        path = tmp_path / f"dcp-load-rank-{rank}.json"
        assert path.exists(), output[-4000:]
        report = json.loads(path.read_text())
        assert not report["errors"], report["errors"]
        assert 0 < report["read"] <= 1.05 * report["held"], report


# -- one process: dtypes, strides, refusals ---------------------------------------------------
def _dcp_save(path: Path, state: dict[str, Any]) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def test_every_dtype_and_a_transposed_tensor_read_as_torch_wrote_them(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    from unimesh_torch.translate import to_host

    g = torch.Generator().manual_seed(1)
    state = {
        "f64": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "f32": torch.randn(4, 4, generator=g),
        "f16": torch.randn(6, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "i64": torch.arange(-5, 5),
        "i32": torch.arange(7, dtype=torch.int32),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(9, dtype=torch.uint8),
        "b": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "t": torch.arange(12.0).reshape(3, 4).t(),  # stored with strides (1, 4)
        "nested": {"w": torch.ones(2, 2)},
        "step": 7,
    }
    _dcp_save(tmp_path / "c", state)
    ck = unimesh.open_checkpoint(tmp_path / "c")
    assert ck.objects == ["step"]
    assert "nested.w" in ck.names
    for name, value in state.items():
        if name in ("step", "nested"):
            continue
        want = to_host(value.contiguous())
        got = ck.read(name)
        assert got.dtype == want.dtype, name
        assert got.tobytes() == want.tobytes(), name
    # a slice of the transposed tensor, and of a row-major one (only its bytes)
    np.testing.assert_array_equal(ck.read("t", (slice(1, 3), slice(1, 2))),
                                  state["t"].numpy()[1:3, 1:2])  # fmt: skip
    before = ck.bytes_read
    np.testing.assert_array_equal(ck.read("f32", (slice(1, 3),)), state["f32"].numpy()[1:3])
    assert ck.bytes_read - before == 2 * 4 * 4


def test_command_line_shows_and_verifies_a_dcp_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    from unimesh.cli import main

    _dcp_save(tmp_path / "c", {"a": torch.ones(4, 2), "b": torch.zeros(3)})
    assert main(["checkpoint", "verify", str(tmp_path / "c")]) == 0
    assert "sound (2 tensors" in capsys.readouterr().out
    assert main(["checkpoint", "show", "--json", str(tmp_path / "c")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tensors"]["a"]["shape"] == [4, 2]


class _Evil:
    """A pickle that calls os.system when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


_AUDITED = """
import sys
import encodings.cp437, unimesh, unimesh.checkpoint.dcp, unimesh.checkpoint.orbax, zipfile
events = []
def hook(event, args):
    if event in ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "exec",
                 "os.spawn", "ctypes.dlopen", "compile", "import"):
        events.append(event if event != "import" else "import " + str(args[0]))
sys.addaudithook(hook)
try:
    unimesh.open_checkpoint(sys.argv[1])
    print("OPENED")
except unimesh.CheckpointError as exc:
    print("REFUSED", exc)
print("EVENTS", sorted(set(events)))
"""


def _audited(path: Path) -> str:
    out = subprocess.run([sys.executable, "-c", _AUDITED, str(path)], capture_output=True,
                         text=True, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_metadata_pickle_that_would_run_code_is_refused_and_nothing_runs(
    tmp_path: Path,
) -> None:
    """Needs no torch: the hostile pickle is made with the standard library."""
    marker = tmp_path / "ran"
    ck = tmp_path / "c"
    ck.mkdir()
    (ck / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": _Evil(marker)}))
    out = _audited(ck)
    assert "REFUSED" in out and "system" in out, out
    assert "EVENTS []" in out, out
    assert not marker.exists()


def _metadata_with(tmp_path: Path, change: Any) -> Path:
    """A real one-process DCP checkpoint whose .metadata is rewritten by ``change`` (applied
    to torch's own Metadata object, then pickled by torch's classes)."""
    torch = pytest.importorskip("torch")
    ck = tmp_path / "c"
    _dcp_save(ck, {"a": torch.arange(6.0).reshape(2, 3)})
    meta = pickle.loads((ck / ".metadata").read_bytes())  # our own file, torch's classes
    change(meta, ck)
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    return ck


def _storage(meta: Any) -> Any:
    return next(iter(meta.storage_data.values()))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m, ck: setattr(_storage(m), "relative_path", "../elsewhere.distcp"),
         "plain names"),
        (lambda m, ck: setattr(_storage(m), "relative_path", "/etc/passwd"), "plain names"),
        (lambda m, ck: setattr(_storage(m), "relative_path", "gone.distcp"), "missing"),
        (lambda m, ck: setattr(_storage(m), "transform_descriptors", ["zstd"]),
         "storage transforms"),
        (lambda m, ck: setattr(_storage(m), "offset", 10**12), "outside the file"),
        (lambda m, ck: setattr(_storage(m), "length", 40), "not a readable torch.save"),
        (lambda m, ck: setattr(m.state_dict_metadata["a"].chunks[0], "sizes", (1, 3)),
         "holds shape|tile"),
        (lambda m, ck: setattr(m.state_dict_metadata["a"], "size", (2, 2)), "reaches past"),
        (lambda m, ck: m.storage_data.clear(), "no storage entry"),
        (lambda m, ck: (ck / "__0_0.distcp").write_bytes(b"PK" + b"\0" * 30), "outside|readable"),
        (lambda m, ck: os.symlink(ck / "__0_0.distcp", ck / "link.distcp")
         or setattr(_storage(m), "relative_path", "link.distcp"), "symlink"),
    ],
)  # fmt: skip
def test_a_damaged_dcp_checkpoint_is_refused_naming_what(
    tmp_path: Path, change: Any, message: str
) -> None:
    ck = _metadata_with(tmp_path, change)
    with pytest.raises(CheckpointError, match=message):
        unimesh.open_checkpoint(ck)


def test_a_chunk_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    """The .distcp chunk's own data.pkl goes through a restricted unpickler too."""
    import io
    import zipfile

    torch = pytest.importorskip("torch")
    ck = tmp_path / "c"
    _dcp_save(ck, {"a": torch.arange(4.0)})
    path = ck / "__0_0.distcp"
    raw = path.read_bytes()
    archive = zipfile.ZipFile(io.BytesIO(raw))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as new:
        for info in archive.infolist():
            body = archive.read(info)
            if info.filename.endswith("data.pkl"):
                body = pickle.dumps(_Evil(tmp_path / "ran"), protocol=2)
            new.writestr(info.filename, body)
    path.write_bytes(out.getvalue())
    meta = pickle.loads((ck / ".metadata").read_bytes())
    _storage(meta).length = len(out.getvalue())
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    result = _audited(ck)
    assert "REFUSED" in result and "system" in result, result
    assert "EVENTS []" in result, result
    assert not (tmp_path / "ran").exists()


def test_hugging_face_dcp_shards_must_tile_their_tensor(tmp_path: Path) -> None:
    """HuggingFaceStorageWriter(save_distributed=True) files: the global shape is inferred
    from the chunks as DCP does, then checked (DCP's reader does not: pytorch#189945)."""
    st = pytest.importorskip("safetensors.numpy")

    def shard(name: str, offsets: list[int], value: np.ndarray) -> None:
        info = json.dumps({"w": {"saved_offsets": offsets}})
        st.save_file({"w": value}, str(tmp_path / name), metadata={"DCP_SHARDING_INFO": info})

    shard("shard-00001-model-00001-of-00001.safetensors", [0, 0], np.zeros((2, 4), np.float32))
    shard("shard-00002-model-00001-of-00001.safetensors", [4, 0], np.ones((2, 4), np.float32))
    with pytest.raises(CheckpointError, match="tile"):
        unimesh.open_checkpoint(tmp_path)
    shard("shard-00003-model-00001-of-00001.safetensors", [2, 0], np.full((2, 4), 2, np.float32))
    ck = unimesh.open_checkpoint(tmp_path)
    assert ck.tensor("w").shape == (6, 4)
    np.testing.assert_array_equal(ck.read("w")[:, 0], [0, 0, 2, 2, 1, 1])
    (tmp_path / "plain.safetensors").write_bytes((tmp_path / "shard-00001-model-00001-of-00001."
                                                  "safetensors").read_bytes()[:0])  # fmt: skip
    st.save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(CheckpointError, match="DCP_SHARDING_INFO"):
        unimesh.open_checkpoint(tmp_path)


def test_a_memo_slot_beyond_the_pickle_is_refused_at_once(tmp_path: Path) -> None:
    """Found by benchmarks/fuzz.py: one mutated byte of a real .metadata asked the C unpickler
    for memo slot 1298491233, and it zero-filled a 10 GB table first (25 s). Refused before
    the unpickler runs, in far less time than that."""
    import struct
    import time

    ck = tmp_path / "c"
    ck.mkdir()
    (ck / ".metadata").write_bytes(b"\x80\x02N" + b"r" + struct.pack("<I", 1298491233) + b".")
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="memo slot 1298491233"):
        unimesh.open_checkpoint(ck)
    assert time.perf_counter() - t0 < 5.0


def test_a_dcp_checkpoint_converts_to_hugging_face_safetensors(tmp_path: Path) -> None:
    """`unimesh checkpoint convert DCP_DIR DST --to safetensors`: torch's checkpoint as
    Hugging Face files, every tensor the same."""
    torch = pytest.importorskip("torch")
    from unimesh.checkpoint import to_safetensors

    _dcp_save(tmp_path / "c", {"w": torch.arange(12.0).reshape(3, 4),
                               "b": torch.ones(5, dtype=torch.int64), "step": 1})  # fmt: skip
    to_safetensors(tmp_path / "c", tmp_path / "hf")
    dcp, hf = unimesh.open_checkpoint(tmp_path / "c"), unimesh.open_checkpoint(tmp_path / "hf")
    assert hf.kind == "safetensors" and sorted(hf.names) == ["b", "w"]
    for name in hf.names:
        assert hf.read(name).tobytes() == dcp.read(name).tobytes()
