"""Neutral config files (TOML/JSON): what they read as, exact round trips, and clear errors."""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import unimesh
from unimesh import AxisRules, Config, ConfigError, LayoutMap, Mesh, P, load_config

from .support.strategies import meshes, specs

TOML = """
mesh = "dp=2,tp=4"
batch_axis = "dp"

[layout]
"encoder/.*/kernel" = "_,tp"
"encoder/.*/bias" = ["tp"]
"embed" = [["dp", "tp"], "_"]

[axis_rules]
batch = "dp"
mlp = "tp"
embed = "_"
"""


def test_toml_reads_as_the_core_objects(tmp_path):
    path = tmp_path / "dist.toml"
    path.write_text(TOML)
    config = load_config(path)
    mesh = Mesh((2, 4), ("dp", "tp"))
    assert config.mesh == mesh and config.batch_axis == "dp"
    assert config.layout_map == LayoutMap(
        mesh,
        [
            ("encoder/.*/kernel", P(None, "tp")),
            ("encoder/.*/bias", P("tp")),
            ("embed", P(("dp", "tp"), None)),
        ],
    )
    assert config.layout_map.get("encoder/layer_3/kernel").spec == P(None, "tp")
    assert config.axis_rules == AxisRules([("batch", "dp"), ("mlp", "tp"), ("embed", None)])
    assert config.axis_rules.spec(("batch", "mlp")) == P("dp", "tp")
    # the same config as JSON, from a file and from text, and as an already parsed dict
    (tmp_path / "dist.json").write_text(config.to_json())
    assert load_config(tmp_path / "dist.json") == config
    assert Config.from_json(config.to_json()) == config
    assert load_config(json.loads(config.to_json())) == config


def test_mesh_tables_and_defaults():
    c = Config.from_toml("[mesh]\naxes = {data = 2, model = 2}\ndevice_ids = [[3, 2], [1, 0]]")
    assert c.mesh == Mesh((2, 2), ("data", "model"), [[3, 2], [1, 0]])
    assert c.batch_axis == "data" and len(c.layout_map) == 0 and c.axis_rules is None
    d = Config.from_json(json.dumps({"mesh": Mesh((2, 2), ("a", "b")).to_dict()}))
    assert d.mesh == Mesh((2, 2), ("a", "b"))
    assert Config.from_toml(f'mesh = "{c.mesh.to_string()}"').mesh == c.mesh  # ids kept


@given(st.data())
def test_json_round_trip_is_exact(data):
    mesh = data.draw(meshes(max_ndim=4, max_size=64))
    rules = [
        (f"layer_{i}/.*", data.draw(specs(mesh, partial=False)))
        for i in range(data.draw(st.integers(0, 3)))
    ]
    axis = data.draw(st.sampled_from(mesh.axis_names))
    config = Config(
        mesh, LayoutMap(mesh, rules), axis, AxisRules([("batch", axis), ("none", None)])
    )
    again = Config.from_json(config.to_json())
    assert again == config
    assert [v.spec for v in again.layout_map.values()] == [s for _, s in rules]
    assert np.array_equal(again.mesh.device_ids, mesh.device_ids)


MAXTEXT_RULES = """
mesh = "data=1,fsdp=2,tensor=2,expert=2"
axis_rules = [
  ["activation_batch", ["data", "fsdp"]],
  ["embed", ["fsdp", "expert"]],
  ["embed", "fsdp"],
  ["q_lora", ["fsdp", "expert"]],
  ["q_lora", "fsdp"],
  ["q_lora", "_"],
  ["mlp", ["tensor", "expert"]],
  ["norm", "_"],
]
"""


def test_axis_rules_as_an_ordered_list_keep_every_fallback():
    """MaxText's rule lists name `embed`, `q_lora`, ... more than once; a table cannot."""
    c = Config.from_toml(MAXTEXT_RULES)
    assert c.axis_rules == AxisRules(
        [
            ("activation_batch", ("data", "fsdp")),
            ("embed", ("fsdp", "expert")),
            ("embed", "fsdp"),
            ("q_lora", ("fsdp", "expert")),
            ("q_lora", "fsdp"),
            ("q_lora", None),
            ("mlp", ("tensor", "expert")),
            ("norm", None),
        ]
    )
    # flax.linen.logical_to_mesh_axes gives these (rule order decides: embed's first rule
    # takes "expert" before mlp's rule is read)
    assert c.axis_rules.spec(("embed", "mlp")) == P(("fsdp", "expert"), None)
    assert c.axis_rules.spec(("activation_batch", "q_lora")) == P(("data", "fsdp"), None)
    assert c.axis_rules.spec(("mlp", "q_lora")) == P(None, ("fsdp", "expert"))
    text = c.to_json()
    assert isinstance(json.loads(text)["axis_rules"], list)  # duplicates: written as a list
    assert Config.from_json(text) == c
    assert Config.from_json(text).axis_rules.rules == c.axis_rules.rules  # order kept
    as_json = json.dumps({"mesh": "dp=2", "axis_rules": [["b", "dp"], ["b", None]]})
    assert Config.from_json(as_json).axis_rules == AxisRules([("b", "dp"), ("b", None)])


BAD = [
    # (text in TOML, error class, text the message must contain)
    ("mesh = 1", ConfigError, "got 1"),
    ("batch_axis = 'dp'", ConfigError, "needs a mesh"),
    ("mesh = 'dp=2'\nlayers = 3", ConfigError, "'layers'"),
    ("mesh = 'dp=2'\nbatch_axis = 'tp'", ConfigError, "'tp'"),
    ("mesh = 'dp=2'\nbatch_axis = 3", ConfigError, "3"),
    ("mesh = 'dp=2'\nlayout = 'dp'", ConfigError, "'dp'"),
    ("mesh = 'dp=2'\n[layout]\nk = 'tp'", unimesh.LayoutError, "'tp'"),
    ("mesh = 'dp=2'\n[layout]\nk = 5", ConfigError, "5"),
    ("mesh = 'dp=2'\n[layout]\n'(' = 'dp'", ConfigError, "LayoutMap key '(' is not a regex"),
    ("mesh = 'dp=2'\n[layout]\nk = ['dp', 'dp']", unimesh.LayoutError, "'dp'"),
    ("mesh = 'dp=2'\naxis_rules = 4", ConfigError, "4"),
    ("mesh = 'dp=2'\n[axis_rules]\nbatch = 'tp'", ConfigError, "'tp'"),
    ("mesh = 'dp=2'\n[axis_rules]\nbatch = 7", unimesh.LayoutError, "7"),
    ("mesh = 'dp=2'\naxis_rules = [['b', 'dp', 'tp']]", ConfigError, "axis_rules[0]"),
    ("mesh = 'dp=2'\naxis_rules = ['b']", ConfigError, "'b'"),
    ("mesh = 'dp=2'\naxis_rules = [['b', 'dp'], 3]", ConfigError, "axis_rules[1] is 3"),
    ("mesh = 'dp=2'\naxis_rules = [[3, 'dp']]", unimesh.LayoutError, "3"),
    ("mesh = 'dp=2'\naxis_rules = [['b', 'tp']]", ConfigError, "'tp'"),
    ("mesh = 'dp=2'\naxis_rules = [['b', ['dp', 9]]]", unimesh.LayoutError, "9"),
    ("mesh = 'dp=0'", unimesh.MeshSpecError, "0"),
    ("mesh = 'dp=1000000000000'", unimesh.MeshSpecError, "1000000000000"),
    ("mesh = 'dp=2;ids=0,0'", unimesh.MeshSpecError, "0"),
    ("[mesh]\naxes = 3", ConfigError, "3"),
    ("[mesh]\naxes = {}", ConfigError, "{}"),
    ("[mesh]\naxes = {a = 2}\nshape = [2]", ConfigError, "not both"),
    ("[mesh]\naxes = {a = -2}", unimesh.MeshSpecError, "-2"),
    ("[mesh]\naxes = {a = 1000000, b = 1000000}", unimesh.MeshSpecError, "1000000"),
    # any printable name is an axis name (issue 50); a control character is not
    ('[mesh]\naxes = {"a\\tb" = 2}', unimesh.MeshSpecError, "'a\\tb'"),
    ("[mesh]\naxes = {a = 2}\ncolour = 'red'", unimesh.MeshSpecError, "'colour'"),
    ("mesh = ", ConfigError, "not valid TOML"),
    ("mesh = 'dp=2'\nmesh = 'dp=4'", ConfigError, "not valid TOML"),
]


@pytest.mark.parametrize("text,cls,named", BAD, ids=[b[0][:30] for b in BAD])
def test_bad_config_names_the_value(text, cls, named):
    t0 = time.perf_counter()
    with pytest.raises(cls) as info:
        Config.from_toml(text)
    assert named in str(info.value), str(info.value)
    assert time.perf_counter() - t0 < 1.0


def test_bad_files_and_sources(tmp_path):
    with pytest.raises(ConfigError, match="must end in .toml or .json"):
        load_config(tmp_path / "dist.yaml")
    with pytest.raises(ConfigError, match="cannot read config file .*missing.toml"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="bin.json.* not UTF-8"):
        load_config(tmp_path / "bin.json")
    with pytest.raises(ConfigError, match="takes a file path or a dict, got 42"):
        load_config(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"not valid JSON"):
        Config.from_json("{" * 100_000)
    with pytest.raises(ConfigError, match="at most"):
        Config.from_json(" " * 2_000_000)
    with pytest.raises(ConfigError, match="a config is a table/object, got \\[1, 2\\]"):
        Config.from_json("[1, 2]")


@given(st.text(max_size=200))
def test_any_text_is_a_config_or_a_unimesh_error(text):
    for parse in (Config.from_toml, Config.from_json):
        with contextlib.suppress(unimesh.UnimeshError):
            parse(text)
