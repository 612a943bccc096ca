"""Checkpoints, first slice (issue 35): the planner in pure numpy (hypothesis over boxes, uneven
and strided layouts), the strict format (manifest and safetensors headers), numpy trees, and
JAX on 8 devices saved on one mesh and layout and loaded onto another, bit-exact, each read
counted in bytes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import unimesh
from unimesh import CheckpointError, Layout, Mesh, P
from unimesh.checkpoint.format import DTYPES, Box, parse_manifest
from unimesh.checkpoint.runs import pieces, runs
from unimesh.checkpoint.safetensors_file import read_header

from .support.strategies import meshes, specs


# -- the planner --------------------------------------------------------------------------------
def _read_via_runs(
    data: np.ndarray, box: Box, start: tuple[int, ...], stop: tuple[int, ...]
) -> Any:
    """Apply the byte runs to the box's bytes (as a file would hold them)."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    got = b"".join(
        raw[o - box.start : o - box.start + n].tobytes()
        for o, n in runs(box, start, stop, data.itemsize)
    )
    shape = tuple(b - a for a, b in zip(start, stop))
    return np.frombuffer(got, dtype=data.dtype).reshape(shape)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_runs_read_exactly_the_region(data: st.DataObject) -> None:
    ndim = data.draw(st.integers(0, 4))
    size = tuple(data.draw(st.integers(1, 5)) for _ in range(ndim))
    offset = tuple(data.draw(st.integers(0, 3)) for _ in range(ndim))
    block = np.arange(math.prod(size), dtype=np.int32).reshape(size)
    box = Box(offset, size, "f", 1000, 1000 + block.nbytes)
    start, stop = [], []
    for o, n in zip(offset, size):
        a = data.draw(st.integers(o, o + n - 1))
        b = data.draw(st.integers(a + 1, o + n))
        start.append(a)
        stop.append(b)
    got = _read_via_runs(block, box, tuple(start), tuple(stop))
    want = block[tuple(slice(a - o, b - o) for a, b, o in zip(start, stop, offset))]
    np.testing.assert_array_equal(got, want)
    total = sum(n for _, n in runs(box, tuple(start), tuple(stop), 4))
    assert total == want.nbytes  # not one byte more than the region


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_pieces_of_any_saved_layout_assemble_any_target_block(data: st.DataObject) -> None:
    """Saved boxes from one layout (uneven, tuple axes) and any target block of another: the
    pieces tile the block, and their bytes add up to the block's bytes exactly."""
    mesh = data.draw(meshes(max_size=8))
    saved = Layout(mesh, data.draw(specs(mesh)))
    target = Layout(mesh, data.draw(specs(mesh)))
    ndim = max(len(saved.spec), len(target.spec), 1)
    shape = tuple(data.draw(st.integers(1, 9)) for _ in range(ndim))
    whole = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    boxes, files, at = [], {}, 0
    seen = set()
    for sl in saved.device_slices(shape).values():
        key = tuple((s.start, s.stop) for s in sl)
        block = whole[sl]
        if key in seen or block.size == 0:
            continue
        seen.add(key)
        box = Box(tuple(a for a, _ in key), block.shape, "f", at, at + block.nbytes)
        files[box.start] = block
        boxes.append(box)
        at += block.nbytes
    flat = b"".join(np.ascontiguousarray(files[b.start]).tobytes() for b in boxes)
    for device in target.mesh.device_ids.ravel()[:3]:
        sl = target.shard_slices(shape, int(device))
        start = tuple(s.start for s in sl)
        stop = tuple(max(s.start, s.stop) for s in sl)
        out = np.full(tuple(b - a for a, b in zip(start, stop)), -1, dtype=np.int64)
        nbytes = 0
        for piece in pieces(boxes, start, stop, 8):
            buf = b"".join(flat[o : o + n] for o, n in piece.runs)
            where = tuple(slice(a - s, b - s) for a, b, s in zip(piece.start, piece.stop, start))
            out[where] = np.frombuffer(buf, dtype=np.int64).reshape(piece.shape)
            nbytes += len(buf)
        np.testing.assert_array_equal(out, whole[sl])
        assert nbytes == out.nbytes


# -- the format ---------------------------------------------------------------------------------
def _manifest(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": "unimesh-checkpoint",
        "version": 1,
        "tensors": {
            "w": {
                "shape": [4, 2],
                "dtype": "float32",
                "layout": None,
                "boxes": [
                    {"offset": [0, 0], "size": [2, 2], "file": "d.safetensors", "start": 8,
                     "end": 24},
                    {"offset": [2, 0], "size": [2, 2], "file": "d.safetensors", "start": 24,
                     "end": 40},
                ],
            }
        },
    }  # fmt: skip
    doc.update(changes)
    return doc


def _box(**changes: Any) -> dict[str, Any]:
    doc = _manifest()
    doc["tensors"]["w"]["boxes"][1].update(changes)
    return doc


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"\xff", "not UTF-8"),
        (b"[]", "must be a JSON object"),
        (b'{"format": 1, "format": 2}', "duplicate key"),
        (json.dumps(_manifest(extra=1)).encode(), "unknown fields ['extra']"),
        (json.dumps(_manifest(version=2)).encode(), "format version 2"),
        (json.dumps(_box(offset=[1, 0])).encode(), "overlap"),
        (json.dumps(_box(offset=[3, 0])).encode(), "reaches past dim 0"),
        # the second box pointed at the first box's bytes (issue 50): loaded as two copies
        (json.dumps(_box(start=8, end=24)).encode(), "share bytes 8..24 of d.safetensors"),
        (json.dumps(_box(start=16, end=32)).encode(), "share bytes 16..24 of d.safetensors"),
        (json.dumps(_box(end=39)).encode(), "is 15 bytes, but"),
        (json.dumps(_box(file="../x")).encode(), "plain names inside the checkpoint"),
        (json.dumps(_box(file="/etc/passwd")).encode(), "plain names inside the checkpoint"),
        (json.dumps(_box(start=-1)).encode(), "must be an int in [0, 2**62)"),
        (json.dumps(_box(start=2**70)).encode(), "must be an int in [0, 2**62)"),
        ((b'{"format": "unimesh-checkpoint", "version": 1, "tensors": {"w": {"shape": [1], '
          b'"dtype": "complex64", "boxes": []}}}'), "unknown dtype 'complex64'"),
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b"[" * 100000, "not valid JSON"),
    ],
)  # fmt: skip
def test_a_bad_manifest_is_refused_naming_what(text: bytes, message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        parse_manifest(text, "m.json")
    assert message in str(info.value)


def test_a_manifest_over_the_cap_is_refused_before_a_byte_is_read(tmp_path, monkeypatch) -> None:
    """A 2 GiB manifest (a sparse file) was read 256 MiB deep before being refused; now its
    size is checked first, as safetensors caps its header, by load and open_checkpoint."""
    import builtins

    import unimesh
    from unimesh.checkpoint.format import MAX_HEADER

    root = tmp_path / "ckpt"
    root.mkdir()
    with open(root / "manifest.json", "wb") as f:
        f.truncate(2 << 30)
    reads: list[int] = []
    real_open = builtins.open

    class Counting:
        def __init__(self, f: Any) -> None:
            self.f = f

        def read(self, n: int = -1) -> bytes:
            data = self.f.read(n)
            reads.append(len(data))
            return data

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, *args, **kwargs)
        return Counting(f) if str(file).endswith("manifest.json") else f

    monkeypatch.setattr(builtins, "open", counting_open)
    for call in (lambda: unimesh.open_checkpoint(root), lambda: unimesh.load(root, {})):
        with pytest.raises(CheckpointError, match=f"is {2 << 30} bytes, over the {MAX_HEADER}"):
            call()
    assert sum(reads) == 0


def test_a_hole_is_refused() -> None:
    doc = _manifest()
    doc["tensors"]["w"]["boxes"].pop()
    with pytest.raises(CheckpointError, match="tile it exactly once"):
        parse_manifest(json.dumps(doc).encode(), "m.json")


def _st(entries: dict[str, tuple[str, list[int], int, int]]) -> bytes:
    """The first bytes of a safetensors file whose header has ``entries``; its data follows
    (the ``size`` given with it counts from the start of the data)."""
    doc = {k: {"dtype": d, "shape": s, "data_offsets": [a, b]} for k, (d, s, a, b) in
           entries.items()}  # fmt: skip
    text = json.dumps(doc).encode()
    return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize(
    ("head", "size", "message"),
    [
        (b"\x01", 10, "shorter than a safetensors header"),
        ((2**40).to_bytes(8, "little"), 100, "over the cap or longer than the file"),
        ((6).to_bytes(8, "little") + b'{"a":1', 14, "not valid JSON"),
        ((2).to_bytes(8, "little") + b"[]", 10, "not a JSON object"),
        (_st({"a": ("F32", [2], 0, 8), "b": ("F32", [2], 4, 12)}), 12, "overlaps the entry"),
        (_st({"a": ("F32", [1], 0, 4), "b": ("F32", [1], 8, 12)}), 12, "bytes 4..8 unused"),
        (_st({"a": ("F32", [1], 0, 4)}), 8, "after the last entry are unused"),
        (_st({"a": ("F32", [3], 0, 8)}), 8, "do not fit its shape or file"),
        (_st({"a": ("C64", [1], 0, 8)}), 8, "unknown dtype 'C64'"),
        (_st({"a": ("F32", [1], 0, 2**64)}), 8, "must be an int"),
    ],
)
def test_a_bad_safetensors_header_is_refused(head: bytes, size: int, message: str) -> None:
    if head.startswith(b"{", 8):  # a header from _st: ``size`` counts the data after it
        size += len(head)
    with pytest.raises(CheckpointError) as info:
        read_header(head, size, "d.safetensors")
    assert message in str(info.value)


# -- numpy trees --------------------------------------------------------------------------------
def test_numpy_tree_round_trip_and_stock_safetensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tree = {
        "layers": [
            {"w": rng.standard_normal((5, 3)).astype(np.float32), "n": np.arange(4)},
            {"w": rng.standard_normal((2, 2)), "mask": rng.random(6) > 0.5},
        ],
        "step": np.array(7, dtype=np.int32),
        "h": rng.standard_normal((3,)).astype(np.float16),
        "q": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "i": np.arange(6, dtype=np.int8),
    }
    unimesh.save(tmp_path / "ck", tree)
    ck = unimesh.open_checkpoint(tmp_path / "ck")
    assert ck.names == ["h", "i", "layers.0.n", "layers.0.w", "layers.1.mask", "layers.1.w",
                        "q", "step"]  # fmt: skip
    import optree

    leaves = dict(zip(ck.names, optree.tree_leaves(tree)))
    for name, want in leaves.items():
        got = ck.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), name
    assert ck.bytes_read == sum(v.nbytes for v in leaves.values())
    part = unimesh.open_checkpoint(tmp_path / "ck")
    np.testing.assert_array_equal(part.read("layers.0.w", (slice(1, 3), slice(2, 3))),
                                  tree["layers"][0]["w"][1:3, 2:3])  # fmt: skip
    assert part.bytes_read == 2 * 4
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    (data,) = [p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors"]
    stock = safetensors_numpy.load_file(str(data))
    assert stock["layers.0.w@0,0"].tobytes() == tree["layers"][0]["w"].tobytes()
    assert len(stock) == len(leaves)


def test_a_second_save_replaces_the_first_and_cleans_up(tmp_path: Path) -> None:
    unimesh.save(tmp_path / "ck", {"a": np.zeros(3)})
    first = sorted(os.listdir(tmp_path / "ck"))
    (tmp_path / "ck" / "data-leftover-00001.safetensors").write_bytes(b"killed save")
    unimesh.save(tmp_path / "ck", {"a": np.ones(3)})
    second = sorted(os.listdir(tmp_path / "ck"))
    assert len(second) == 2 and set(first) & set(second) == {"manifest.json"}
    np.testing.assert_array_equal(unimesh.open_checkpoint(tmp_path / "ck").read("a"), np.ones(3))


def test_read_region_into_a_given_array(tmp_path: Path) -> None:
    """``Checkpoint.read_region(..., out=)`` fills a writable C-order array of the region's
    shape and the tensor's item size (any dtype of that size: the bytes are the tensor's), and
    refuses any other array by name before reading."""
    values = np.arange(48, dtype=np.float32).reshape(6, 8)
    unimesh.save(tmp_path / "c", {"w": values})
    with unimesh.open_checkpoint(tmp_path / "c") as ck:
        t = ck.tensor("w")
        out = np.zeros((2, 3), dtype=np.int32)  # 4-byte items: float32's bytes, as int32
        assert ck.read_region(t, (1, 2), (3, 5), out) is out
        np.testing.assert_array_equal(out.view(np.float32), values[1:3, 2:5])
        wrong = {
            "shape": np.zeros((3, 2), np.float32),
            "item size": np.zeros((2, 3), np.float64),
            "order": np.zeros((3, 2), np.float32).T,
            "writable": np.broadcast_to(np.float32(0), (2, 3)),
        }
        for what, array in wrong.items():
            with pytest.raises(CheckpointError, match=r"'w' cannot be read into a \w+ array of "
                               r"shape .*: its region \(2, 3\) needs a writable C-order array "
                               r"of 4-byte items"):  # fmt: skip
                ck.read_region(t, (1, 2), (3, 5), array)
            assert ck.bytes_read == 2 * 3 * 4, what  # nothing more was read


def test_a_load_target_with_a_pending_reduction_is_refused(tmp_path: Path) -> None:
    """A checkpoint holds values: loading one into a Partial layout (torch would sum the
    copies of every block, giving the value times the axis size) is refused by name, before
    a byte is read, on every backend."""
    unimesh.save(tmp_path / "c", {"w": np.arange(16, dtype=np.float32).reshape(4, 4)})
    mesh = Mesh((2,), ("x",), axis_types=("explicit",))
    stats: dict[str, int] = {}
    for backend in ("jax", "torch", "mlx"):
        target = {"w": Layout(mesh, P(None, None, partial={"x": "sum"}))}
        with pytest.raises(CheckpointError, match="'w' is laid out as a pending reduction"):
            unimesh.load(tmp_path / "c", target, backend=backend, stats=stats)
    assert not stats


def test_reading_errors_name_the_tensor_and_file(tmp_path: Path) -> None:
    unimesh.save(tmp_path / "ck", {"attn": {"wq": np.zeros((4, 4), np.float32)}})
    ck = unimesh.open_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"no tensor 'attn\.wk'.*did you mean 'attn\.wq'"):
        ck.read("attn.wk")
    with pytest.raises(CheckpointError, match="must have step 1"):
        ck.read("attn.wq", (slice(0, 4, 2),))
    (data,) = [p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors"]
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="do not fit its shape or file"):
        unimesh.open_checkpoint(tmp_path / "ck").read("attn.wq")
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        unimesh.open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="dtype complex128 cannot be checkpointed"):
        unimesh.save(tmp_path / "c2", {"z": np.zeros(2, np.complex128)})
    with pytest.raises(CheckpointError, match="no arrays"):
        unimesh.save(tmp_path / "c3", {})


def test_every_dtype_name_has_a_safetensors_code() -> None:
    assert {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8",
            "bool"} <= set(DTYPES)  # fmt: skip


# -- JAX, 8 devices: one mesh and layout to another --------------------------------------------
def test_jax_reshard_load_is_bit_exact_and_reads_only_its_bytes(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    import ml_dtypes

    saved_mesh = Mesh.from_string("dp=4,tp=2")
    rng = np.random.default_rng(3)
    tree = {
        "w": rng.standard_normal((8, 6)).astype(np.float32),
        "b16": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
        "h": rng.standard_normal((4, 8)).astype(np.float16),
        "n": np.arange(16, dtype=np.int32).reshape(4, 4),
        "m": rng.random(8) > 0.5,
        "z": np.zeros((0, 4), np.float32),  # no element: no block, nothing to read
    }
    saved = {"w": P("dp", "tp"), "b16": P(("tp", "dp")), "h": P(None, ("dp", "tp")), "n": P(),
             "m": P("dp"), "z": P("dp", "tp")}  # fmt: skip
    arrays = {
        k: jax.device_put(v, unimesh.to_native(Layout(saved_mesh, saved[k]), "jax"))
        for k, v in tree.items()
    }
    unimesh.save(tmp_path / "ck", {"model": arrays})
    ck = unimesh.open_checkpoint(tmp_path / "ck")
    assert ck.layout("model.w") == Layout(saved_mesh, P("dp", "tp"))
    # the replicated tensor is written once, not eight times
    assert len(ck.tensor("model.n").boxes) == 1
    target_mesh = Mesh((2, 4), ("a", "b"), np.arange(8)[::-1].reshape(2, 4))
    target = {"w": P("b", "a"), "b16": P("a"), "h": P(None, ("b", "a")), "n": P(None, "b"),
              "m": P(("a", "b")), "z": P("b", "a")}  # fmt: skip
    layouts = {"model": {k: Layout(target_mesh, s) for k, s in target.items()}}
    loaded = unimesh.load(tmp_path / "ck", layouts, backend="jax")
    for k, want in tree.items():
        got = loaded["model"][k]
        assert unimesh.from_native(got.sharding) == layouts["model"][k]
        assert np.asarray(got).tobytes() == want.tobytes(), k
    # one block read on its own reads only that block's bytes
    part = unimesh.open_checkpoint(tmp_path / "ck")
    sl = layouts["model"]["w"].shard_slices((8, 6), 5)
    part.read("model.w", sl)
    assert part.bytes_read == math.prod(s.stop - s.start for s in sl) * 4
    # into native arrays: shape and dtype must match
    again = unimesh.load(tmp_path / "ck", {"model": {"w": loaded["model"]["w"]}}, strict=False)
    assert np.asarray(again["model"]["w"]).tobytes() == tree["w"].tobytes()
    wrong = jax.device_put(np.zeros((8, 6), np.float16), loaded["model"]["w"].sharding)
    with pytest.raises(CheckpointError, match="is float32 in .*, the target float16"):
        unimesh.load(tmp_path / "ck", {"model": {"w": wrong}})
    cast = unimesh.load(tmp_path / "ck", {"model": {"w": wrong}}, dtype=np.float16)
    np.testing.assert_array_equal(np.asarray(cast["model"]["w"]), tree["w"].astype(np.float16))
    with pytest.raises(CheckpointError, match="no tensor 'model.v'"):
        unimesh.load(tmp_path / "ck", {"model": {"v": layouts["model"]["w"]}}, backend="jax")


def test_async_save_copies_first_writes_later_and_saves_in_order(tmp_path: Path) -> None:
    x = np.arange(10, dtype=np.float64)
    handle = unimesh.async_save(tmp_path / "ck", {"x": x})
    x[:] = -1  # after the call returns, the caller's array is its own again
    second = unimesh.async_save(tmp_path / "ck", {"x": np.full(3, 7.0)})  # waits for the first
    assert handle.done()
    second.wait()
    assert second.done()
    np.testing.assert_array_equal(
        unimesh.open_checkpoint(tmp_path / "ck").read("x"), np.full(3, 7.0)
    )
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    failed = unimesh.async_save(blocker / "ck", {"x": np.zeros(2)})
    with pytest.raises(CheckpointError, match=r"could not create the directory: Not a directory"):
        failed.wait()
    unimesh.save(tmp_path / "after", {"x": np.zeros(2)})  # a failed save does not block others


def test_command_line_show_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from unimesh.cli.main import main

    tree = {"enc": {"w": np.zeros((4, 3), np.float32)}, "step": np.array(3)}
    unimesh.save(tmp_path / "ck", tree)
    assert main(["checkpoint", "show", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "enc.w" in out and "4x3" in out and "float32" in out and "2 tensors" in out
    assert main(["checkpoint", "show", str(tmp_path / "ck"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tensors"]["enc.w"] == {"shape": [4, 3], "dtype": "float32", "mesh": None,
                                        "spec": None, "boxes": 1, "bytes": 48}  # fmt: skip
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 0
    assert "sound" in capsys.readouterr().out
    # a header that disagrees with the manifest: same size, another dtype
    manifest = tmp_path / "ck" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["tensors"]["enc.w"]["dtype"] = "int32"
    manifest.write_text(json.dumps(doc))
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 1
    out = capsys.readouterr().out
    assert "tensor 'enc.w': the manifest says int32 (4, 3)" in out and "its header float32" in out
    # a missing data file
    for data in (tmp_path / "ck").glob("data-*"):
        data.unlink()
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 1
    assert "is missing or not a file" in capsys.readouterr().out
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    assert "has no manifest.json" in capsys.readouterr().out


@given(
    st.lists(st.integers(0, 6), min_size=0, max_size=4),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 200),
)
def test_export_slabs_cover_the_array_in_c_order_within_the_window(
    shape: list[int], itemsize: int, window: int
) -> None:
    from unimesh.checkpoint.huggingface import _slabs

    shape_t = tuple(shape)
    order = np.arange(math.prod(shape_t)).reshape(shape_t)
    seen: list[int] = []
    for box in _slabs(shape_t, itemsize, window):
        part = order[box]
        assert part.size * itemsize <= max(window, itemsize)
        seen.extend(part.reshape(-1).tolist())
    assert seen == list(range(math.prod(shape_t)))  # every element once, in C order


def test_convert_to_hugging_face_safetensors(tmp_path: Path) -> None:
    """convert --to safetensors: the stock loaders read the files unchanged (safetensors'
    numpy loader, and mx.load where MLX is installed); sharded with an index past
    --max-shard-size; a progress bar on stderr; no framework imported."""
    import json
    import subprocess
    import sys

    from safetensors.numpy import load_file

    rng = np.random.default_rng(5)
    tree = {
        "layers": {"0": {"w": rng.standard_normal((64, 33)).astype(np.float32)}},
        "emb": rng.standard_normal((7, 5)).astype(np.float16),
        "ids": np.arange(12, dtype=np.int64).reshape(3, 4),
        "flag": np.array([True, False]),
    }
    unimesh.save(tmp_path / "ck", tree)
    flat = {"layers.0.w": tree["layers"]["0"]["w"], "emb": tree["emb"], "ids": tree["ids"],
            "flag": tree["flag"]}  # fmt: skip
    code = (
        "import sys; from unimesh.cli.main import main; rc = main(sys.argv[1:]); "
        "assert not {'torch', 'jax', 'mlx', 'tensorflow'} & set(sys.modules); sys.exit(rc)"
    )
    cli = [sys.executable, "-c", code, "checkpoint", "convert"]
    run = subprocess.run(
        [*cli, str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "safetensors",
         "--max-shard-size", "4KB"], capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "converting" in run.stderr and "3 files" in run.stdout, (run.stdout, run.stderr)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(flat)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in flat.values())
    got: dict[str, np.ndarray] = {}
    for file in sorted(set(index["weight_map"].values())):
        got.update(load_file(tmp_path / "hf" / file))
    for name, want in flat.items():
        assert got[name].dtype == want.dtype and got[name].tobytes() == want.tobytes(), name
    one = unimesh.checkpoint.to_safetensors(tmp_path / "ck", tmp_path / "one", window=64)
    assert one == ["model.safetensors"]
    single = load_file(tmp_path / "one" / "model.safetensors")
    assert all(single[k].tobytes() == v.tobytes() for k, v in flat.items())
    mx = pytest.importorskip("mlx.core")
    loaded = mx.load(str(tmp_path / "one" / "model.safetensors"))
    for name, want in flat.items():
        assert np.array(loaded[name]).tobytes() == want.tobytes(), name
    with pytest.raises(CheckpointError, match="into its source"):
        unimesh.checkpoint.to_safetensors(tmp_path / "ck", tmp_path / "ck")
    bad = subprocess.run([*cli, str(tmp_path / "ck"), str(tmp_path / "x"), "--to",
                          "safetensors", "--max-shard-size", "lots"], capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert bad.returncode == 2 and "not a size: 'lots'" in bad.stderr, bad.stderr


def test_hugging_face_safetensors_load_onto_a_mesh_reading_only_their_bytes(
    tmp_path: Path,
) -> None:
    """A sharded Hugging Face checkpoint (model.safetensors.index.json) written by the stock
    safetensors library, and one model.safetensors, load onto JAX layouts bit-exact, each
    process reading only its blocks' bytes; an index naming a file outside the directory is
    refused."""
    jax = pytest.importorskip("jax")
    import json

    from safetensors.numpy import save_file

    rng = np.random.default_rng(9)
    weights = {
        "model.embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.layers.0.mlp.w": rng.standard_normal((8, 24)).astype(np.float16),
        "model.norm.bias": rng.standard_normal(8).astype(np.float32),
    }
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(
        {k: weights[k] for k in list(weights)[:2]}, str(hf / "model-00001-of-00002.safetensors")
    )
    save_file(
        {"model.norm.bias": weights["model.norm.bias"]},
        str(hf / "model-00002-of-00002.safetensors"),
    )
    index = {"metadata": {"total_size": 0}, "weight_map": {
        "model.embed.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.mlp.w": "model-00001-of-00002.safetensors",
        "model.norm.bias": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = unimesh.open_checkpoint(hf)
    assert ck.kind == "safetensors" and sorted(ck.names) == sorted(weights)
    assert (
        ck.tensor("model.layers.0.mlp.w").dtype == "float16"
        and ck.layout("model.norm.bias") is None
    )
    mesh = Mesh.from_string("dp=2,tp=4")
    target = {"model": {"embed": {"weight": Layout(mesh, P("tp", None))},
                        "layers": {"0": {"mlp": {"w": Layout(mesh, P(None, ("dp", "tp")))}}},
                        "norm": {"bias": Layout(mesh, P())}}}  # fmt: skip
    stats: dict[str, int] = {}
    got = unimesh.load(hf, target, backend="jax", stats=stats)
    assert isinstance(got["model"]["embed"]["weight"], jax.Array)
    assert (
        np.asarray(got["model"]["layers"]["0"]["mlp"]["w"]).tobytes()
        == weights["model.layers.0.mlp.w"].tobytes()
    )
    assert (
        np.asarray(got["model"]["embed"]["weight"]).tobytes()
        == weights["model.embed.weight"].tobytes()
    )
    assert stats["bytes_read"] == stats["bytes_held"]
    # one block of one tensor reads just that block
    part = unimesh.open_checkpoint(hf)
    part.read("model.embed.weight", (slice(4, 6),))
    assert part.bytes_read == 2 * 8 * 4
    # a single file, by directory or by its own path; the command line checks it
    single = tmp_path / "one"
    single.mkdir()
    save_file(weights, str(single / "model.safetensors"))
    for where in (single, single / "model.safetensors"):
        loaded = unimesh.load(
            where, {"model.norm.bias": Layout(mesh, P("tp"))}, backend="jax", strict=True
        )
        assert (
            np.asarray(loaded["model.norm.bias"]).tobytes() == weights["model.norm.bias"].tobytes()
        )
    from unimesh.cli.checkpoint import problems

    assert problems(str(hf)) == [] and problems(str(single)) == []
    # hostile indexes: a path out of the directory, a symlink, a tensor its file lacks
    for bad, message in (
        ("../one/model.safetensors", "plain names inside the checkpoint directory"),
        ("/etc/passwd", "plain names inside the checkpoint directory"),
        ("link.safetensors", "missing, not a file or a symlink"),
    ):
        (hf / "link.safetensors").unlink(missing_ok=True)
        (hf / "link.safetensors").symlink_to(single / "model.safetensors")
        index["weight_map"]["model.norm.bias"] = bad
        (hf / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match=message):
            unimesh.open_checkpoint(hf)
    index["weight_map"]["model.norm.bias"] = "model-00001-of-00002.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="puts tensor 'model.norm.bias' in model-00001"):
        unimesh.open_checkpoint(hf)


def test_checksums_catch_a_changed_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every saved box carries an xxh3_64 of its bytes (xxhash's own digest, in the manifest
    as 16 hex digits): load(verify=True), open_checkpoint(verify=True) and `unimesh checkpoint
    verify` find a byte changed after the save, naming the tensor, box and file; without
    verify a read trusts the file (and reads only its bytes)."""
    import xxhash

    from unimesh.cli.main import main

    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    unimesh.save(tmp_path / "ck", {"w": w, "b": np.ones(4, np.float16)})
    ck = unimesh.open_checkpoint(tmp_path / "ck")
    box = ck.tensor("w").boxes[0]
    assert box.checksum == ("xxh3", xxhash.xxh3_64_intdigest(w.tobytes()))
    listed = json.loads((tmp_path / "ck" / "manifest.json").read_text())["tensors"]
    assert listed["b"]["boxes"][0]["xxh3"] == xxhash.xxh3_64_hexdigest(np.ones(4, np.float16))
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 0
    good = unimesh.open_checkpoint(tmp_path / "ck", verify=True)
    assert good.read("w", (slice(0, 1),)).tobytes() == w[:1].tobytes()
    assert good.bytes_read == w.nbytes + 32  # the whole box checked, then its first row read
    data = tmp_path / "ck" / box.file
    raw = bytearray(data.read_bytes())
    raw[box.start + 40] ^= 0x01  # one bit of row 1
    data.write_bytes(bytes(raw))
    message = r"tensor 'w', the box at \[0, 0\] in data-\w+-00000.safetensors .* fails its checksum"
    with pytest.raises(CheckpointError, match=message):
        unimesh.open_checkpoint(tmp_path / "ck", verify=True).read("w", (slice(0, 1),))
    assert unimesh.open_checkpoint(tmp_path / "ck").read("w", (slice(0, 1),)).tobytes() == (
        w[:1].tobytes()
    )  # row 0 is intact, and without verify only its bytes are read
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 1
    assert "fails its checksum" in capsys.readouterr().out
    bad = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    entry = bad["tensors"]["w"]["boxes"][0]
    for value in ["ABCDEF0123456789", "0x12", 12, "g" * 16, "1" * 17, None]:
        entry["xxh3"] = value
        with pytest.raises(CheckpointError, match=r"xxh3 must be 16 lowercase hex digits"):
            parse_manifest(json.dumps(bad).encode(), "m.json")
    entry["crc32"] = 5
    with pytest.raises(CheckpointError, match=r"give one checksum, crc32 or xxh3, not both"):
        parse_manifest(json.dumps(bad).encode(), "m.json")
    del entry["xxh3"]
    entry["crc32"] = -1
    with pytest.raises(CheckpointError, match=r"crc32 must be an int in \[0, 2\*\*32\)"):
        parse_manifest(json.dumps(bad).encode(), "m.json")


def test_an_earlier_saves_crc32_is_still_checked(tmp_path: Path) -> None:
    """Checkpoints written before the xxh3 checksum carry zlib's crc32 per box: they load and
    verify as before, and a changed byte still fails its crc32."""
    import zlib

    w = np.arange(48, dtype=np.float32).reshape(6, 8)
    unimesh.save(tmp_path / "ck", {"w": w})
    path = tmp_path / "ck" / "manifest.json"
    doc = json.loads(path.read_text())
    (entry,) = doc["tensors"]["w"]["boxes"]
    del entry["xxh3"]
    entry["crc32"] = zlib.crc32(w.tobytes())
    path.write_text(json.dumps(doc))
    ck = unimesh.open_checkpoint(tmp_path / "ck", verify=True)
    assert ck.tensor("w").boxes[0].checksum == ("crc32", zlib.crc32(w.tobytes()))
    np.testing.assert_array_equal(ck.read("w", (slice(2, 4),)), w[2:4])
    data = tmp_path / "ck" / entry["file"]
    raw = bytearray(data.read_bytes())
    raw[entry["start"] + 7] ^= 0x80
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"fails its checksum: crc32 0x[0-9a-f]{8}, the"):
        unimesh.open_checkpoint(tmp_path / "ck", verify=True).read("w", (slice(0, 1),))


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), 1e9, True, "10"])
def test_a_bad_save_timeout_is_refused(tmp_path: Path, timeout: Any) -> None:
    with pytest.raises(CheckpointError, match=r"timeout must be a number of seconds, > 0"):
        unimesh.save(tmp_path / "ck", {"x": np.zeros(2)}, timeout=timeout)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_shard_bytes", 0), ("window", -5), ("window", 2.5), ("max_shard_bytes", True),
     ("window", 2**70)],
)  # fmt: skip
def test_bad_export_sizes_are_refused(tmp_path: Path, option: str, value: Any) -> None:
    unimesh.save(tmp_path / "ck", {"x": np.zeros(2)})
    with pytest.raises(CheckpointError, match=rf"{option} must be a positive int of bytes"):
        unimesh.checkpoint.to_safetensors(tmp_path / "ck", tmp_path / "hf", **{option: value})


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_stretches_of_a_region_are_its_bytes_in_c_order(data: st.DataObject) -> None:
    """load() reads a piece's runs straight into the destination block, each contiguous
    stretch of the block's region one iovec: the stretches hold numpy's bytes of the region,
    in its order."""
    from unimesh.checkpoint.raw import stretches as _stretches

    shape = tuple(data.draw(st.integers(1, 4)) for _ in range(data.draw(st.integers(0, 4))))
    where = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        where.append(slice(a, data.draw(st.integers(a + 1, n))))
    block = np.arange(math.prod(shape), dtype=np.int16).reshape(shape)
    raw = block.reshape(-1).view(np.uint8)
    got = b"".join(raw[at : at + n].tobytes() for at, n in _stretches(block, tuple(where)))
    assert got == block[tuple(where)].tobytes()


def test_a_region_of_more_stretches_than_one_preadv_takes(tmp_path: Path) -> None:
    """Columns of a row-saved tensor: 3000 stretches, more than the 1024 iovecs of one preadv
    call, read straight into place and bit-exact; only the region's bytes are read."""
    values = np.arange(3000 * 8, dtype=np.float32).reshape(3000, 8)
    unimesh.save(tmp_path / "ck", {"w": values})
    ck = unimesh.open_checkpoint(tmp_path / "ck")
    got = ck.read("w", (slice(None), slice(2, 5)))
    np.testing.assert_array_equal(got, values[:, 2:5])
    assert ck.bytes_read == 3000 * 3 * 4
    np.testing.assert_array_equal(ck.read("w", (slice(7, 2990), slice(1, 8))), values[7:2990, 1:])


_READ_MODES = {  # raw's switches, set so that each way of reading is taken on small data
    "one preadv at a time": {"READ_THREADS": 1, "_MIN_STRIDED": 10**9},
    "reads in flight": {"READ_THREADS": 3, "_MIN_SHARE": 1, "_MAX_CALL": 40, "_MIN_STRIDED": 10**9},
    "copied out of a mapping": {"READ_THREADS": 1, "_MIN_STRIDED": 2, "_MAP_SPAN": 100},
    "a file that cannot be mapped": {"READ_THREADS": 1, "_MIN_STRIDED": 2},
}


@settings(max_examples=200, deadline=None)
@given(data=st.data(), mode=st.sampled_from(sorted(_READ_MODES)))
def test_scatter_read_puts_every_run_in_place_however_it_reads(
    data: st.DataObject, mode: str
) -> None:
    """A saved box's region read into the region of a larger block, by each of the ways a
    load reads (one preadv after another; several threads in flight, long runs split; a
    column block copied out of a mapping of the file, or by preadv where it cannot be mapped):
    numpy's values there, nothing written outside it; a file cut short is a CheckpointError
    naming the tensor, in every way."""
    import contextlib
    import tempfile
    from unittest import mock

    from unimesh.checkpoint import raw

    ndim = data.draw(st.integers(1, 3))
    size = tuple(data.draw(st.integers(1, 12)) for _ in range(ndim))
    pad = data.draw(st.integers(0, 70))
    box_values = np.arange(math.prod(size), dtype=np.int32).reshape(size) * 7 + 1
    box = Box((0,) * ndim, size, "f", pad, pad + box_values.nbytes)
    start, stop, where, outer = [], [], [], []
    for n in size:
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, n))
        before, after = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
        start.append(a)
        stop.append(b)
        where.append(slice(before, before + b - a))
        outer.append(before + b - a + after)
    byte_runs = runs(box, tuple(start), tuple(stop), 4)
    want = box_values[tuple(slice(a, b) for a, b in zip(start, stop))]
    unmappable = mock.patch("mmap.mmap", side_effect=OSError("no mmap here"))
    with (
        tempfile.TemporaryDirectory() as tmp,
        mock.patch.multiple(raw, **_READ_MODES[mode]),
        unmappable if mode == "a file that cannot be mapped" else contextlib.nullcontext(),
    ):
        path = Path(tmp) / "f"
        path.write_bytes(b"\xee" * pad + box_values.tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            out = np.full(outer, -5, dtype=np.int32)
            raw.scatter_read(fd, byte_runs.table, out, tuple(where), "file f", "w")
            np.testing.assert_array_equal(out[tuple(where)], want)
            outside = np.ones(out.shape, bool)
            outside[tuple(where)] = False
            assert (out[outside] == -5).all()
            os.truncate(path, byte_runs[-1][0] + byte_runs[-1][1] - 1)  # the last byte gone
            with pytest.raises(CheckpointError, match="file f is truncated .tensor 'w' needs"):
                raw.scatter_read(fd, byte_runs.table, out, tuple(where), "file f", "w")
        finally:
            os.close(fd)


def test_data_files_stay_open_for_reads_and_close_after(tmp_path: Path) -> None:
    """A Checkpoint keeps each data file it read open (one descriptor per file, so the
    kernel's read-ahead runs on from block to block) until close() or the end of its with
    block; load() leaves no descriptor behind."""
    values = {"a": np.arange(64, dtype=np.float32), "b": np.ones((4, 4), np.int32)}
    unimesh.save(tmp_path / "ck", values)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = fds()
    with unimesh.open_checkpoint(tmp_path / "ck") as ck:
        np.testing.assert_array_equal(ck.read("a", (slice(8, 16),)), values["a"][8:16])
        np.testing.assert_array_equal(ck.read("b"), values["b"])
        assert fds() == before + 1  # one data file, opened once for both reads
    assert fds() == before
    np.testing.assert_array_equal(ck.read("a"), values["a"])  # reopened on demand
    ck.close()
    got = unimesh.load(tmp_path / "ck", {"a": np.empty(64, np.float32)}, strict=False)
    np.testing.assert_array_equal(got["a"], values["a"])
    assert fds() == before


def test_replicated_blocks_are_written_by_the_holder_with_the_least_to_write() -> None:
    """DCP's own setup (dp=2 x tp=2; 4 tensors at [Shard(0), Shard(1)], 4 at [Replicate(),
    Shard(0)], MiB): every block is written once, a block one process holds by that process,
    and the replicas spread so that each process writes 144 MiB (the first holder of each
    replica would write 208 MiB on processes 0 and 1 and 80 on 2 and 3)."""
    from unimesh.checkpoint.saving import writers

    held: list[list[tuple[str, int]]] = [[] for _ in range(4)]
    for t in range(4):  # [Shard(0), Shard(1)]: a 16 MiB block of its own on every process
        for r in range(4):
            held[r].append((f"s{t}@{r}", 16))
    for t in range(4):  # [Replicate(), Shard(0)]: rows of tp coordinate c on processes c, c + 2
        for c in range(2):
            for r in (c, c + 2):
                held[r].append((f"r{t}@{c}", 32))
    for r in range(4):  # two 8 MiB bfloat16 blocks of its own
        held[r] += [(f"b0@{r}", 8), (f"b1@{r}", 8)]
    writer = writers(held)
    keys = {key for blocks in held for key, _ in blocks}
    assert set(writer) == keys
    for r, blocks in enumerate(held):
        for key, _ in blocks:
            assert writer[key] in [p for p, bs in enumerate(held) if key in dict(bs)]
            if key[0] in "sb":
                assert writer[key] == r
    written = [sum(n for key, n in blocks if writer[key] == r) for r, blocks in enumerate(held)]
    assert written == [144] * 4
    assert writers(held) == writer  # the same lists give the same answer on every process


def test_a_checksum_that_fails_in_the_save_names_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure while the save thread checksums the blocks (here: xxhash missing, as in an
    install made with --no-deps) is a CheckpointError naming the cause and the fix, and the
    checkpoint already there stays loadable; verify says the same."""
    import builtins

    from unimesh.checkpoint import format as fmt

    unimesh.save(tmp_path / "ck", {"w": np.ones(4, np.float32)})
    real = builtins.__import__

    def no_xxhash(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "xxhash":
            raise ImportError("No module named 'xxhash'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xxhash)
    with pytest.raises(CheckpointError, match=r"could not checksum .*pip install xxhash"):
        unimesh.save(tmp_path / "ck", {"w": np.zeros(4, np.float32)})
    with pytest.raises(CheckpointError, match=r"pip install xxhash"):
        fmt.hasher("xxh3")
    monkeypatch.setattr(builtins, "__import__", real)
    ck = unimesh.open_checkpoint(tmp_path / "ck", verify=True)
    np.testing.assert_array_equal(ck.read("w", (slice(0, 4),)), np.ones(4, np.float32))


def test_one_process_reads_a_tensors_blocks_box_by_box_in_file_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process holding 8 devices' column blocks of row-major boxes reads the tensor's
    parts box by box, in file order (each box once from the disk, one pass along the file),
    not device by device; the values are the saved ones either way and bytes read = bytes
    held. Above TOGETHER_MAX (the load's memory bound) blocks are read one at a time."""
    jax = pytest.importorskip("jax")
    from unimesh.checkpoint import loading
    from unimesh.checkpoint.reader import Checkpoint

    w = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    saved = jax.device_put(
        w, unimesh.to_native(Layout(Mesh.from_string("x=4,y=2"), P("x", "y")), "jax")
    )
    unimesh.save(tmp_path / "ck", {"w": saved})
    columns = {"w": Layout(Mesh.from_string("all=8"), P(None, "all"))}
    real = Checkpoint._read_part
    for limit, in_order in ((loading.TOGETHER_MAX, True), (0, False)):
        seen: list[tuple[str, int]] = []

        def spy(self: Any, t: Any, box: Any, *rest: Any, seen: list[Any] = seen) -> None:
            seen.append((box.file, box.start))
            real(self, t, box, *rest)

        monkeypatch.setattr(Checkpoint, "_read_part", spy)
        monkeypatch.setattr(loading, "TOGETHER_MAX", limit)
        stats: dict[str, int] = {}
        got = unimesh.load(tmp_path / "ck", columns, backend="jax", stats=stats, verify=True)
        np.testing.assert_array_equal(np.asarray(got["w"]), w)
        assert stats["bytes_read"] == stats["bytes_held"] + w.nbytes  # verify read each box once
        assert len(seen) == 32  # 8 blocks, each from 4 boxes
        assert (seen == sorted(seen)) is in_order, seen
    # devices sharing a block (replicated over y): each distinct block read once
    shared = {"w": Layout(Mesh.from_string("x=4,y=2"), P(None, "x"))}
    stats = {}
    got = unimesh.load(tmp_path / "ck", shared, backend="jax", stats=stats)
    np.testing.assert_array_equal(np.asarray(got["w"]), w)
    assert stats["bytes_read"] == stats["bytes_held"] == w.nbytes


def test_load_with_sources_fuses_slices_and_renames_block_by_block(tmp_path: Path) -> None:
    """A Hugging Face-style q/k/v checkpoint into one fused qkv, a part of a saved fused
    tensor, and a rename, on JAX's 8 devices: each device's block is its slice of numpy's
    concatenate / slice, and each process reads only the bytes of its blocks."""
    pytest.importorskip("jax")
    import unimesh
    from unimesh import Concat, Layout, Mesh, P, Slice

    rng = np.random.default_rng(3)
    saved = {
        "q": rng.standard_normal((8, 6)).astype(np.float32),
        "k": rng.standard_normal((4, 6)).astype(np.float32),
        "v": rng.standard_normal((4, 6)).astype(np.float32),
        "gate_up": rng.standard_normal((6, 10)).astype(np.float32),
    }
    unimesh.save(str(tmp_path / "c"), saved)
    mesh = Mesh((2, 4), ("dp", "tp"))
    target = {
        "qkv": Layout(mesh, P("tp", "dp")),
        "up": Layout(mesh, P(None, "tp")),
        "query": Layout(mesh, P("dp")),
    }
    stats: dict[str, int] = {}
    got = unimesh.load(
        str(tmp_path / "c"),
        target,
        backend="jax",
        stats=stats,
        sources={
            "qkv": Concat(["q", "k", "v"], 0),
            "up": Slice("gate_up", 1, 2, 10),
            "query": "q",
        },
    )
    want = {
        "qkv": np.concatenate([saved["q"], saved["k"], saved["v"]]),
        "up": saved["gate_up"][:, 2:10],
        "query": saved["q"],
    }
    for name, layout in target.items():
        assert got[name].shape == want[name].shape
        for device, block in unimesh.local_shards(got[name]).items():
            assert np.array_equal(block, want[name][layout.shard_slices(want[name].shape, device)])
    # one process holds every block: it reads the target's bytes, not the whole saved tensors
    assert stats["bytes_read"] <= sum(w.nbytes for w in want.values())
    with pytest.raises(unimesh.CheckpointError, match="has no tensor 'o'"):
        unimesh.load(str(tmp_path / "c"), {"x": target["qkv"]}, backend="jax",
                     sources={"x": Concat(["q", "o"], 0)})  # fmt: skip
    with pytest.raises(unimesh.CheckpointError, match="differ outside dim 1"):
        unimesh.load(str(tmp_path / "c"), {"x": target["qkv"]}, backend="jax",
                     sources={"x": Concat(["q", "k"], 1)})  # fmt: skip
    with pytest.raises(unimesh.CheckpointError, match="does not have"):
        unimesh.load(str(tmp_path / "c"), target, backend="jax", sources={"nope": "q"})
