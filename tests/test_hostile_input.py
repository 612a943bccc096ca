"""The second audit's hostile inputs (issue 17): LayoutMap keys are RE2 regexes (linear-time
matching, the same answers as Python's ``re.fullmatch`` wherever both accept a key), mesh and
backend size limits named, config round trips that hold, and non-numeric arrays refused."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import unimesh
from unimesh import (
    Config,
    ConfigError,
    ConversionError,
    Layout,
    LayoutError,
    LayoutMap,
    Mesh,
    P,
    UnsupportedError,
)

M = Mesh((2,), ("a",))

# a small regex grammar over the alphabet paths use: both engines accept all of it
_ATOM = st.sampled_from(["a", "b", "/", ".", "[ab]", "[^a]", r"\d", "1", r"\."])
_QUANT = st.sampled_from(["", "", "*", "+", "?", "{1,2}", "*?"])


def _regex() -> st.SearchStrategy[str]:
    piece = st.tuples(_ATOM, _QUANT).map("".join)
    seq = st.lists(piece, min_size=1, max_size=4).map("".join)
    return st.recursive(
        seq,
        lambda inner: st.one_of(
            st.tuples(inner, inner).map(lambda ab: f"({ab[0]}|{ab[1]})"),
            st.tuples(inner, _QUANT).map(lambda g: f"({g[0]}){g[1]}"),
            st.tuples(inner, inner).map("".join),
        ),
        max_leaves=6,
    )


@settings(max_examples=400, deadline=None)
@given(
    keys=st.lists(_regex(), min_size=1, max_size=6, unique=True),
    path=st.text(alphabet="ab/.1", max_size=10),
)
def test_lookup_agrees_with_python_re(keys: list[str], path: str) -> None:
    """Which keys match a path (and so the answer or the 'more than one key' error) is what
    Python's re.fullmatch says, key order included."""
    layouts = LayoutMap(M, {k: P("a" if i % 2 else None) for i, k in enumerate(keys)})
    hits = [k for k in keys if re.fullmatch(k, path)]
    if path in keys:
        assert layouts.get(path) == layouts.items()[keys.index(path)][1]
    elif len(hits) > 1:
        with pytest.raises(LayoutError, match="matches more than one LayoutMap key") as info:
            layouts.get(path)
        assert f"{hits[0]!r} and {hits[1]!r}" in str(info.value)
    elif hits:
        assert layouts.get(path) == layouts.items()[keys.index(hits[0])][1]
    else:
        assert layouts.get(path) is None


@pytest.mark.parametrize(
    "key, short",
    [
        (r"(a+)+$", "aaa"),
        (r"(a|a)*b", "aab"),
        (r"(a*)*b", "ab"),
        (r"(a|aa)+c", "aac"),
        (r"(.*a){12}", "a" * 12),
    ],
)
def test_backtracking_keys_finish(key: str, short: str) -> None:
    """Keys on which Python's re backtracks exponentially (seconds at 25 characters, years at
    100,000) give the right answer: RE2 matches in linear time."""
    layouts = LayoutMap(M, {key: P("a")})
    assert layouts.get("a" * 100_000 + "!") is None
    assert re.fullmatch(key, short) and layouts.get(short) == Layout(M, P("a"))


def test_huge_and_deep_keys() -> None:
    """A key of 100,000 nested groups and one of 80,000 groups compile (RE2 keeps no Python
    recursion) and match what they should."""
    deep = "(" * 100_000 + "a" + ")" * 100_000
    assert LayoutMap(M, {deep: P("a")}).get("a") == Layout(M, P("a"))
    wide = "(a)" * 80_000
    layouts = LayoutMap(M, {wide: P("a")})
    assert layouts.get("a" * 80_000) == Layout(M, P("a"))
    assert layouts.get("a" * 79_999) is None


def test_many_keys_across_set_chunks() -> None:
    """Regex keys are matched in sets of 512: a key in any set is found, two matches in
    different sets are reported in key order, and deleting a key rebuilds the sets."""
    keys = {f"block_{i}/.*kernel": P("a" if i == 3000 else None) for i in range(5000)}
    layouts = LayoutMap(M, keys)
    assert layouts.get("block_3000/dense/kernel") == Layout(M, P("a"))
    assert layouts.get("block_5000/dense/kernel") is None
    layouts["block_.*00/x"] = P()
    layouts["block_1/.*"] = P()
    with pytest.raises(LayoutError, match=r"'block_1/\.\*kernel' and 'block_1/\.\*'"):
        layouts.get("block_1/kernel")
    del layouts["block_1/.*kernel"]
    assert layouts.get("block_1/kernel") == Layout(M, P())
    assert layouts.get("block_3000/x") == Layout(M, P())
    layouts["plain/key"] = P("a")  # no regex syntax: matches only itself
    assert layouts.get("plain/key") == Layout(M, P("a"))


def test_layout_map_pickles_and_copies_after_lookups() -> None:
    import copy
    import pickle

    layouts = LayoutMap(M, {"x.*": P("a"), "y": P()})
    assert layouts.get("xx") == Layout(M, P("a"))  # builds the RE2 sets
    for again in (pickle.loads(pickle.dumps(layouts)), copy.deepcopy(layouts)):
        assert again == layouts
        assert again.get("xz") == Layout(M, P("a")) and again.get("y") == Layout(M, P())
    assert layouts.get("xq") == Layout(M, P("a"))


@pytest.mark.parametrize("name", ["None", "none", "_"])
def test_config_refuses_axis_names_that_mean_replicated(name: str) -> None:
    with pytest.raises(ConfigError, match=f"mesh axis '{name}' cannot be written in a config"):
        Config(Mesh((2,), (name,)))
    with pytest.raises(ConfigError, match=f"mesh axis '{name}' cannot be written"):
        Config.from_toml(f'mesh = "{name}=2"\n')


def test_config_json_is_never_too_long_to_read_back() -> None:
    """A config near the size limit writes compact JSON (indented would be too long) and reads
    back equal."""
    rules = "\n".join(f'"b_{i}/d/.*k" = ["a"]' for i in range(36_000))
    config = Config.from_toml('mesh = "a=2"\n[layout]\n' + rules + "\n")
    text = config.to_json()
    assert len(text) <= 1_000_000 and "\n" not in text
    assert Config.from_json(text) == config
    small = Config(M)
    assert "\n" in small.to_json() and Config.from_json(small.to_json()) == small


@pytest.mark.parametrize(
    "text, parse",
    [
        ('mesh = "a=2"\nx = ' + "1" * 4400 + "\n", Config.from_toml),
        ('{"mesh": "a=2", "x": ' + "1" * 4400 + "}", Config.from_json),
    ],
    ids=["toml", "json"],
)
def test_config_integers_too_long_to_read(text, parse) -> None:
    with pytest.raises(ConfigError, match="Exceeds the limit .4300 digits"):
        parse(text)


def test_config_layout_keys() -> None:
    with pytest.raises(ConfigError, match=r"config \[layout\]: LayoutMap key '\(\?=a\)'"):
        Config.from_toml('mesh = "a=2"\n[layout]\n"(?=a)" = ["a"]\n')
    with pytest.raises(ConfigError, match=r"\[layout\] keys are pattern strings, got 3"):
        Config.from_dict({"mesh": "a=2", "layout": {3: "a"}})
    config = Config.from_dict({"mesh": "a=2", "layout": {"x.*": "a", "y": ["a"], "z": "a"}})
    assert config.layout_map.get("xx") is config.layout_map.get("z")  # one Layout per spec
    assert config.layout_map.get("y") == Layout(M, P("a"))


def test_jax_refuses_more_axes_than_its_mesh_holds() -> None:
    pytest.importorskip("jax")
    mesh = Mesh((1,) * 33, tuple(f"a{i}" for i in range(33)))
    with pytest.raises(UnsupportedError, match=r"33 axes is more than a jax mesh holds \(32\)"):
        unimesh.to_native(mesh, backend="jax")
    with pytest.raises(UnsupportedError, match="33 axes"):
        unimesh.to_native(Layout(mesh, P()), backend="jax")
    ok = Mesh((1,) * 32, tuple(f"a{i}" for i in range(32)))
    assert unimesh.from_native(unimesh.to_native(ok, backend="jax")) == ok


@pytest.mark.parametrize("backend", ["jax", "torch", "mlx", "tensorflow"])
@pytest.mark.parametrize("dtype", ["<U1", "S1", "O", "datetime64[D]"])
def test_distribute_refuses_arrays_of_non_numbers(backend: str, dtype: str) -> None:
    """Before any framework sees them, whichever backend is named."""
    array = np.zeros(2, dtype=dtype) if dtype != "O" else np.array([object(), 1])
    with pytest.raises(ConversionError, match=f"got one of dtype {re.escape(str(array.dtype))}"):
        unimesh.distribute(array, Layout(M, P()), backend=backend)


def test_jax_shard_params_refuses_a_tree_of_non_arrays() -> None:
    pytest.importorskip("jax")
    one = Mesh((1,), ("a",))
    with pytest.raises(ConversionError, match=r"got <object object .* neither a model nor a"):
        unimesh.shard_params(object(), LayoutMap(one, {}), backend="jax")
    # with a rule that matches nothing it said "paths look like ['']" (issue 50)
    with pytest.raises(ConversionError, match=r"neither a model nor a pytree of parameters"):
        unimesh.shard_params(object(), LayoutMap(one, {"w": P("a")}), backend="jax")
    with pytest.raises(ConversionError, match=r"leaf 'w/0' is 'x' \(str\)"):
        unimesh.shard_params({"w": ["x"]}, LayoutMap(one, {}), backend="jax")
    placed = unimesh.shard_params({"w": np.ones(2, np.float32)}, LayoutMap(one, {}), backend="jax")
    assert json.dumps(np.asarray(placed["w"]).tolist()) == "[1.0, 1.0]"


@pytest.mark.parametrize("value", [[1, 2], (1,), {"a": 1}, "x", 3, None])
def test_full_array_refuses_plain_python_values(value) -> None:
    with pytest.raises(ConversionError, match="full_array.. takes a backend's distributed array"):
        unimesh.full_array(value, backend="jax")
