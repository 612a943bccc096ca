"""Large meshes (issue 16): the fast readers give exactly what the careful ones give, and the
command line stays bounded at 2**20 devices. No timing assertions: sizes and answers only."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from unimesh import Layout, Mesh, MeshSpecError, P
from unimesh._text import json_ids_fast

SHAPE = (64, 64, 16, 16)
NAMES = ("dp", "fsdp", "cp", "tp")


@pytest.fixture(scope="module")
def big() -> Mesh:
    ids = np.random.default_rng(0).permutation(1 << 20).reshape(SHAPE)
    return Mesh(SHAPE, NAMES, ids, devices_per_process=1024)


def _careful(mesh: Mesh) -> Mesh:
    """The mesh rebuilt from Python ints through the nested-list path."""
    return Mesh(mesh.shape, mesh.axis_names, mesh.device_ids.tolist(), devices_per_process=1024)


def test_big_text_and_json_round_trip(big):
    assert Mesh.from_string(big.to_string()) == big
    text = big.to_json()
    assert json_ids_fast(text) is not None  # the compact form takes the numpy path
    assert Mesh.from_json(text) == big
    pretty = json.dumps(big.to_dict(), indent=1)  # another form: json.loads reads it
    assert json_ids_fast(pretty) is None and Mesh.from_json(pretty) == big
    assert _careful(big) == Mesh(SHAPE, NAMES, big.device_ids, devices_per_process=1024) == big


def test_derived_meshes_equal_the_validated_construction(big):
    flat = big.flatten(("dp", "cp"), "dpcp")
    want = big.device_ids.transpose(0, 2, 1, 3).reshape(1024, 64, 16)
    assert flat == Mesh((1024, 64, 16), ("dpcp", "fsdp", "tp"), want, devices_per_process=1024)
    assert flat.device_ids.flags.c_contiguous and not flat.device_ids.flags.writeable
    t = big.transpose(("tp", "cp", "fsdp", "dp"))
    assert t == Mesh(
        t.shape, t.axis_names, big.device_ids.transpose(3, 2, 1, 0).copy(), devices_per_process=1024
    )
    default = Mesh(SHAPE, NAMES).flatten(("dp", "fsdp"), "x")
    assert default.is_default_order  # an adjacent flatten of the default order stays default
    assert not Mesh(SHAPE, NAMES).flatten(("dp", "cp"), "x").is_default_order


@pytest.mark.parametrize(
    "text, want",
    [
        ("a=3;ids=2,0,1", [2, 0, 1]),
        ("a=3;ids=2, 0 ,1", [2, 0, 1]),  # spaces: the careful path
        ("a=3;ids=0002,0,1", [2, 0, 1]),  # leading zeros, both paths
        ("a=2;ids=9223372036854775807,0", [2**63 - 1, 0]),  # int64's top: 19 digits
        ("a=2;ids=1000000000000000000,7", [10**18, 7]),
    ],
)
def test_text_ids_fast_and_careful_agree(text, want):
    mesh = Mesh.from_string(text)
    np.testing.assert_array_equal(mesh.device_ids, want)
    assert Mesh.from_string(mesh.to_string()) == mesh
    assert Mesh.from_json(mesh.to_json()) == mesh


@pytest.mark.parametrize(
    "text, words",
    [
        ("a=3;ids=2,0,", "device id ''"),
        ("a=3;ids=2,,1", "device id ''"),
        ("a=3;ids=,2,1", "device id ''"),
        ("a=2;ids=9223372036854775808,0", "non-negative int64"),
        ("a=2;ids=99999999999999999999,0", "non-negative int64"),
        ("a=2;ids=1,+0", "'+0'"),
        ("a=2;ids=1,1", "appears more than once"),
        ("a=3;ids=2,0", "gives 2 device ids"),
        ("a=\u0662", "cannot read axis"),  # an Arabic-Indic two is not read as 2
        ("a=2;ids=1,\uff10", "device id"),  # nor a full-width zero
    ],
)
def test_text_ids_refused_with_the_value(text, words):
    with pytest.raises(MeshSpecError) as info:
        Mesh.from_string(text)
    assert words in str(info.value), str(info.value)


def _big_json(shape: tuple[int, ...], ids: str) -> str:
    return (
        json.dumps({"axis_names": [f"a{i}" for i in range(len(shape))], "shape": list(shape)})[:-1]
        + f',"device_ids":{ids}}}'
    )


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda t: t.replace("[", "[[", 1), "device_ids"),  # deeper on one side
        (lambda t: t.replace(",", ",,", 1), "not valid mesh JSON"),
        (lambda t: t.replace("1", "1.5", 1), "must be ints"),
        (lambda t: t.replace("]", ",7]", 1), "device_ids"),  # a ragged row
        (lambda t: t.replace("[0,", "[1,", 1), "appears more than once"),
    ],
)
def test_big_json_that_is_not_canonical_gets_the_careful_answer(mutate, words):
    shape = (128, 128)
    ids = json.dumps(np.arange(128 * 128).reshape(shape).tolist(), separators=(",", ":"))
    text = _big_json(shape, mutate(ids))
    assert len(text) > 1 << 16  # large enough for the fast path to be tried
    with pytest.raises(MeshSpecError) as info:
        Mesh.from_json(text)
    assert words in str(info.value), str(info.value)


def _show(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unimesh", "show", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        input=stdin,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
    )


def test_show_of_a_million_devices_is_a_bounded_summary(big, tmp_path):
    spec = tmp_path / "mesh.txt"
    spec.write_text(big.to_string())
    proc = _show(f"@{spec}", "--layout", "dp+fsdp,cp+tp", "--shape", "4096,1024")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert len(out) < 20_000, len(out)
    assert "1,048,576 devices" in out and "--full" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    first = big.device_ids[0, 0, 0, 0]
    last = big.device_ids[-1, -1, -1, -1]
    assert f" {first} p{first // 1024} " in out and f" {last} p{last // 1024} " in out


def test_show_json_of_a_million_devices_is_array_shaped(big, tmp_path):
    spec = tmp_path / "mesh.json"
    spec.write_text(big.to_json())
    proc = _show(f"@{spec}", "--layout", "dp,tp", "--shape", "128,64", "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) < 120 * big.size  # bounded per device: ids, process, blocks
    data = json.loads(proc.stdout)
    np.testing.assert_array_equal(data["device_ids"], big.device_ids)
    np.testing.assert_array_equal(data["process"], big.device_ids // 1024)
    lo, hi = Layout(big, P("dp", "tp")).shard_bounds((128, 64))
    blocks = np.asarray(data["blocks"]).reshape(-1, 2, 2)
    np.testing.assert_array_equal(blocks[:, :, 0], lo)
    np.testing.assert_array_equal(blocks[:, :, 1], hi)


def test_show_reads_a_spec_from_stdin():
    proc = _show("-", stdin="dp=2,tp=2;ids=3,2,1,0\n")
    assert proc.returncode == 0, proc.stderr
    assert "device_ids=[[3, 2], [1, 0]]" in proc.stdout


@pytest.mark.parametrize("path", ["/dev/zero", "/nonexistent/mesh.txt"])
def test_show_refuses_files_that_are_not_regular(path):
    proc = _show(f"@{path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert path in proc.stderr, proc.stderr


def test_device_slices_equal_the_tuples_built_from_shard_bounds():
    mesh = Mesh(
        (4, 2, 3), ("dp", "cp", "tp"), np.random.default_rng(1).permutation(24).reshape(4, 2, 3)
    )
    for spec in [P("dp", "tp"), P(("dp", "cp"), "tp"), P(None, "cp"), P(), P(("tp", "dp", "cp"))]:
        layout = Layout(mesh, spec)
        shape = (10, 7)
        lo, hi = layout.shard_bounds(shape)
        want = {
            d: tuple(slice(a, b) for a, b in zip(r0, r1))
            for d, r0, r1 in zip(mesh.device_ids.ravel().tolist(), lo.tolist(), hi.tolist())
        }
        assert layout.device_slices(shape) == want, spec
        for d in want:
            assert layout.device_slices(shape)[d] == layout.shard_slices(shape, d)


@pytest.mark.parametrize("backend", ["jax", "tensorflow", "keras"])
def test_convert_refuses_a_mesh_too_big_to_simulate_before_the_framework_starts(backend):
    from unimesh import backends

    if backend not in backends():
        pytest.skip(f"{backend} is not installed")
    proc = subprocess.run(
        [sys.executable, "-m", "unimesh", "convert", "dp=1024,tp=1024", "--to", backend],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "1048576 devices" in proc.stderr and "(4096)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_request_devices_names_the_size_and_the_limit():
    import unimesh
    from unimesh import UnsupportedError

    if "jax" not in unimesh.backends():
        pytest.skip("jax is not installed")
    from unimesh.registry import load_backend

    be = load_backend("jax")
    with pytest.raises(UnsupportedError, match=r"needs 8193 devices in one process.*\(4096\)"):
        be.request_devices(8193)
    with pytest.raises(UnsupportedError, match=r"needs 4097 devices"):
        be.request_devices(8193, processes=2)  # 4097 per process


def test_abstract_jax_mesh_of_a_million_devices(big):
    import unimesh

    if "jax" not in unimesh.backends():
        pytest.skip("jax is not installed")
    abstract = unimesh.to_native(big, "jax", abstract=True)
    assert type(abstract).__name__ == "AbstractMesh"
    assert dict(zip(abstract.axis_names, abstract.axis_sizes)) == big.axis_sizes
    back = unimesh.from_native(abstract)  # no devices: the default order
    assert back.shape == big.shape and back.is_default_order


def test_abstract_is_refused_where_a_backend_has_no_device_free_mesh():
    import unimesh
    from unimesh import UnsupportedError

    if "tensorflow" not in unimesh.backends():
        pytest.skip("tensorflow is not installed")
    with pytest.raises(UnsupportedError, match=r"unknown option\(s\) \['abstract'\]"):
        unimesh.to_native(Mesh((2,), ("dp",)), "tensorflow", abstract=True)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_load_config_refuses_what_is_not_a_regular_file(kind, tmp_path):
    import os

    from unimesh import ConfigError, load_config

    path = tmp_path / "dist.toml"
    if kind == "fifo":
        os.mkfifo(path)  # opening it to read would block forever
    elif kind == "device":
        path.symlink_to("/dev/zero")  # reading it would never end
    else:
        path.mkdir()
    with pytest.raises(ConfigError, match="is not a regular file") as info:
        load_config(path)
    assert str(path) in str(info.value)
