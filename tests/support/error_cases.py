"""The catalogue of bad inputs (tests/test_errors.py runs it, tests/test_errors_surface.py
counts it with its own): each a call, the UnimeshError subclass it raises and a fragment of
the message that names the value and the fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import unimesh
from unimesh import (
    AxisRules,
    Layout,
    LayoutError,
    LayoutMap,
    Mesh,
    MeshSpecError,
    P,
    Replicate,
    Shard,
    StridedShard,
    make_mesh,
)

pytestmark = pytest.mark.quick  # framework-free and fast: in the quick tier

M = Mesh((2, 4), ("dp", "tp"))
PERM = Mesh((2, 2), ("dp", "tp"), [[1, 0], [3, 2]])

# (id, callable, error class, fragment that must appear in the message)
CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    # Mesh constructor
    ("shape-str", lambda: Mesh("24", ("a",)), MeshSpecError, "mesh shape must be a tuple or list"),
    ("shape-empty", lambda: Mesh((), ()), MeshSpecError, "at least one axis"),
    ("shape-zero", lambda: Mesh((0,), ("a",)), MeshSpecError, "must be >= 1, got 0"),
    ("shape-negative", lambda: Mesh((2, -2), ("a", "b")), MeshSpecError, "must be >= 1, got -2"),
    ("shape-float", lambda: Mesh((2.0,), ("a",)), MeshSpecError, "must be an int, got 2.0"),
    ("shape-bool", lambda: Mesh((True,), ("a",)), MeshSpecError, "must be an int, got True"),
    (
        "shape-huge",
        lambda: Mesh((10**6, 10**6), ("a", "b")),
        MeshSpecError,
        "1000000000000 devices, more than unimesh supports",
    ),
    ("names-count", lambda: Mesh((2, 2), ("a",)), MeshSpecError, "has 1 names but shape (2, 2)"),
    ("names-dup", lambda: Mesh((2, 2), ("a", "a")), MeshSpecError, "'a' appears more than once"),
    ("names-empty", lambda: Mesh((2,), ("",)), MeshSpecError, "axis name must not be empty"),
    ("names-int", lambda: Mesh((2,), (3,)), MeshSpecError, "axis name must be a str, got 3"),
    (
        "names-control",
        lambda: Mesh((2,), ("a\x00b",)),
        MeshSpecError,
        "axis name 'a\\x00b' holds the unprintable character '\\x00'",
    ),
    (
        "names-long",
        lambda: Mesh((2,), ("x" * 10**6,)),
        MeshSpecError,
        "is 1000000 characters long; the limit is 256",
    ),
    ("names-str", lambda: Mesh((2,), "a"), MeshSpecError, "axis_names must be a tuple or list"),
    (
        "ids-shape",
        lambda: Mesh((2, 2), ("a", "b"), [0, 1, 2]),
        MeshSpecError,
        "device_ids has shape (3,) but the mesh shape is (2, 2)",
    ),
    ("ids-dup", lambda: Mesh((2,), ("a",), [3, 3]), MeshSpecError, "3 appears more than once"),
    ("ids-negative", lambda: Mesh((2,), ("a",), [0, -1]), MeshSpecError, "must be >= 0"),
    ("ids-float", lambda: Mesh((2,), ("a",), [0.5, 1.0]), MeshSpecError, "device_ids must be ints"),
    ("ids-str", lambda: Mesh((2,), ("a",), ["0", "1"]), MeshSpecError, "device_ids must be ints"),
    (
        "ids-ragged",
        lambda: Mesh((2, 2), ("a", "b"), [[0, 1], [2]]),
        MeshSpecError,
        "not a rectangular array",
    ),
    (
        "types-bad",
        lambda: Mesh((2,), ("a",), axis_types=("fast",)),
        MeshSpecError,
        "must be one of 'auto', 'explicit', 'manual', got 'fast'",
    ),
    (
        "types-count",
        lambda: Mesh((2,), ("a",), axis_types=("auto", "auto")),
        MeshSpecError,
        "has 2 entries for 1 axes",
    ),
    (
        "dpp-zero",
        lambda: Mesh((2,), ("a",), devices_per_process=0),
        MeshSpecError,
        "devices_per_process must be >= 1, got 0",
    ),
    # Mesh methods
    (
        "axis-size-unknown",
        lambda: M.axis_size("pp"),
        MeshSpecError,
        "unknown axis 'pp'; this mesh's axes are ('dp', 'tp')",
    ),
    ("coords-missing", lambda: M.coords(8), MeshSpecError, "device 8 is not in Mesh(dp=2, tp=4)"),
    ("coords-missing-perm", lambda: PERM.coords(7), MeshSpecError, "device 7 is not in"),
    ("coords-str", lambda: M.coords("3"), MeshSpecError, "device_id must be an int, got '3'"),
    ("device-at-missing", lambda: M.device_at(dp=1), MeshSpecError, "missing ['tp']"),
    (
        "device-at-range",
        lambda: M.device_at(dp=1, tp=4),
        MeshSpecError,
        "coordinate tp=4 is out of range; axis 'tp' has size 4",
    ),
    ("device-at-extra", lambda: M.device_at(dp=0, tp=0, pp=0), MeshSpecError, "unknown axis 'pp'"),
    ("groups-unknown", lambda: M.groups("pp"), MeshSpecError, "unknown axis 'pp'"),
    ("groups-empty", lambda: M.groups(()), MeshSpecError, "must name at least one axis"),
    ("groups-repeat", lambda: M.groups(("dp", "dp")), MeshSpecError, "repeats an axis"),
    (
        "submesh-ambiguous",
        lambda: M.submesh("tp"),
        MeshSpecError,
        "has 2 candidates; pass containing=<device id>",
    ),
    (
        "submesh-not-in",
        lambda: M.submesh("tp", containing=42),
        MeshSpecError,
        "device 42 is not in",
    ),
    (
        "flatten-clash",
        lambda: Mesh((2, 2, 2), ("a", "b", "c")).flatten(("a", "b"), "c"),
        MeshSpecError,
        "cannot name the flattened axis 'c'",
    ),
    (
        "flatten-badname",
        lambda: M.flatten(("dp", "tp"), "d\np"),
        MeshSpecError,
        "flattened axis name 'd\\np' holds the unprintable character",
    ),
    (
        "unflatten-product",
        lambda: M.unflatten("tp", {"x": 3, "y": 2}),
        MeshSpecError,
        "x=3 x y=2 = 6 devices, but axis 'tp' of size 4 has 4",
    ),
    (
        "unflatten-clash",
        lambda: M.unflatten("tp", {"dp": 2, "y": 2}),
        MeshSpecError,
        "already has an axis of that name",
    ),
    (
        "unflatten-notmap",
        lambda: M.unflatten("tp", [2, 2]),
        MeshSpecError,
        "must be a non-empty mapping",
    ),
    ("rename-unknown", lambda: M.rename({"pp": "x"}), MeshSpecError, "unknown axis 'pp'"),
    (
        "rename-collide",
        lambda: M.rename({"dp": "tp"}),
        MeshSpecError,
        "'tp' appears more than once",
    ),
    ("transpose-partial", lambda: M.transpose(("tp",)), MeshSpecError, "needs every axis once"),
    (
        "local-no-dpp",
        lambda: M.local_device_ids(1),
        MeshSpecError,
        "process_index 1 is out of range",
    ),
    ("local-negative", lambda: M.local_mesh(-1), MeshSpecError, "process_index must be >= 0"),
    # make_mesh
    ("make-notmap", lambda: make_mesh([("dp", 2)]), MeshSpecError, "non-empty mapping"),
    (
        "make-product",
        lambda: make_mesh({"dp": 2, "tp": 4}, 6),
        MeshSpecError,
        "dp=2 x tp=4 = 8 devices, but num_devices=6",
    ),
    (
        "make-zero",
        lambda: make_mesh({"dp": 0}),
        MeshSpecError,
        "size of axis 'dp' must be a positive int or -1, got 0",
    ),
    (
        "make-dcn-notmult",
        lambda: make_mesh({"dp": -1}, 7, dcn_axes={"dp": 2}),
        MeshSpecError,
        "num_devices=7 is not a multiple of the 2 processes",
    ),
    # serial forms
    ("dict-notdict", lambda: Mesh.from_dict([1, 2]), MeshSpecError, "takes a dict, got [1, 2]"),
    (
        "dict-unknown-key",
        lambda: Mesh.from_dict({"shape": [2], "axis_names": ["a"], "ids": []}),
        MeshSpecError,
        "unknown mesh field 'ids'",
    ),
    (
        "dict-missing",
        lambda: Mesh.from_dict({"shape": [2]}),
        MeshSpecError,
        "lacks the required field 'axis_names'",
    ),
    (
        "dict-huge-ids",
        lambda: Mesh.from_dict(
            {"shape": [10**7, 10**7], "axis_names": ["a", "b"], "device_ids": []}
        ),
        MeshSpecError,
        "more than unimesh supports",
    ),
    ("json-bad", lambda: Mesh.from_json("{not json"), MeshSpecError, "not valid mesh JSON"),
    ("json-type", lambda: Mesh.from_json(42), MeshSpecError, "takes a str, got 42"),
    ("json-deep", lambda: Mesh.from_json("[" * 100000), MeshSpecError, "not valid mesh JSON"),
    ("string-type", lambda: Mesh.from_string(None), MeshSpecError, "takes a str, got None"),
    ("string-empty", lambda: Mesh.from_string(""), MeshSpecError, "names no axis"),
    ("string-badaxis", lambda: Mesh.from_string("dp:2"), MeshSpecError, "cannot read axis 'dp:2'"),
    (
        "string-ids-count",
        lambda: Mesh.from_string("dp=2;ids=0"),
        MeshSpecError,
        "gives 1 device ids for a mesh of 2 devices",
    ),
    (
        "string-ids-bad",
        lambda: Mesh.from_string("dp=2;ids=0,x"),
        MeshSpecError,
        "device id 'x' in mesh string",
    ),
    (
        "string-section",
        lambda: Mesh.from_string("dp=2;color=red"),
        MeshSpecError,
        "unknown section 'color=red'",
    ),
    (
        "string-twice",
        lambda: Mesh.from_string("dp=2;per_process=1;per_process=1"),
        MeshSpecError,
        "section 'per_process' appears twice",
    ),
    (
        "string-huge",
        lambda: Mesh.from_string("a=1000000,b=1000000"),
        MeshSpecError,
        "more than unimesh supports",
    ),
    (
        "dtensor-fields",
        lambda: Mesh.from_string("m|x=2|0,1"),
        MeshSpecError,
        "needs 5 '|'-separated fields",
    ),
    (
        "dtensor-count",
        lambda: Mesh.from_string("m|x=2|0|0|/device:CPU:0"),
        MeshSpecError,
        "lists 1 global ids for a mesh of 2 devices",
    ),
    (
        "dtensor-devices",
        lambda: Mesh.from_string("m|x=2|0,1|0,1|/device:CPU:0"),
        MeshSpecError,
        "lists 2 local ids but 1 local devices",
    ),
    (
        "dtensor-device-name",
        lambda: Mesh.from_string("m|x=2|0,1|0,1|cpu0,cpu1"),
        MeshSpecError,
        "device 'cpu0' in DTensor mesh string",
    ),
    (
        "dtensor-ids",
        lambda: Mesh.from_string("m|x=2|0,5|0,5|/d:CPU:0,/d:CPU:1"),
        MeshSpecError,
        "global ids must be 0..1",
    ),
    (
        "dtensor-int",
        lambda: Mesh.from_string("m|x=2|0,a|0,1|/d:CPU:0,/d:CPU:1"),
        MeshSpecError,
        "global id entry 'a'",
    ),
    # PartitionSpec / Layout
    ("spec-int", lambda: P(0), LayoutError, "spec entry 0: 0 (int) is not a spec entry"),
    ("spec-empty-name", lambda: P(""), LayoutError, "an axis name cannot be empty"),
    ("spec-tuple-int", lambda: P(("a", 1)), LayoutError, "must hold axis names"),
    ("spec-repeat", lambda: P("a", ("b", "a")), LayoutError, "axis 'a' appears more than once"),
    (
        "spec-partial-op",
        lambda: P("a", partial={"b": "prod"}),
        LayoutError,
        "reduce op 'prod' for partial axis 'b' is not one of",
    ),
    (
        "spec-partial-repeat",
        lambda: P("a", partial={"a": "sum"}),
        LayoutError,
        "axis 'a' appears more than once",
    ),
    (
        "layout-unknown-axis",
        lambda: Layout(M, P("pp")),
        LayoutError,
        "names axis 'pp', which is not in Mesh(dp=2, tp=4)",
    ),
    ("layout-not-mesh", lambda: Layout("dp=2", P("dp")), LayoutError, "needs a unimesh.Mesh"),
    ("layout-str-spec", lambda: Layout(M, "dp"), LayoutError, "needs a PartitionSpec"),
    (
        "slices-rank",
        lambda: Layout(M, P("dp", "tp")).shard_slices((4,), 0),
        LayoutError,
        "has 2 entries but the tensor shape (4,) has only 1 dims",
    ),
    (
        "slices-negative",
        lambda: Layout(M, P("dp")).shard_slices((-4,), 0),
        LayoutError,
        "must be >= 0, got -4",
    ),
    (
        "slices-device",
        lambda: Layout(M, P("dp")).shard_slices((4,), 99),
        MeshSpecError,
        "device 99 is not in",
    ),
    (
        "slices-shape-str",
        lambda: Layout(M, P("dp")).shard_slices("4", 0),
        LayoutError,
        "global_shape must be a tuple of ints",
    ),
    (
        "placements-count",
        lambda: Layout.from_placements(M, [Shard(0)], 1),
        LayoutError,
        "got 1 placements for a mesh of 2 axes",
    ),
    (
        "placements-dim",
        lambda: Layout.from_placements(M, [Shard(3), Replicate()], 2),
        LayoutError,
        "shards dim 3, out of range for a tensor of 2 dims",
    ),
    (
        "placements-type",
        lambda: Layout.from_placements(M, ["S0", Replicate()], 1),
        LayoutError,
        "placement 'S0' on axis 'dp' is not a Shard",
    ),
    (
        "placements-strided",
        lambda: Layout.from_placements(M, [StridedShard(0, 3), Shard(0)], 1),
        LayoutError,
        "no PartitionSpec equivalent",
    ),
    # LayoutMap / AxisRules
    (
        "layoutmap-regex",
        lambda: LayoutMap(M, {"(": P("dp")}),
        LayoutError,
        "LayoutMap key '(' is not a regex unimesh can match: Python's re refuses it: missing )",
    ),
    ("layoutmap-axis", lambda: LayoutMap(M, {"k": P("pp")}), LayoutError, "names axis 'pp'"),
    (
        "layoutmap-pairs",
        lambda: LayoutMap(M, ["k"]),
        LayoutError,
        "LayoutMap rule 'k' is not a (pattern, spec) pair",
    ),
    (
        "layoutmap-key",
        lambda: LayoutMap(M, {1: P("dp")}),
        LayoutError,
        "LayoutMap keys are regex strings, got 1",
    ),
    (
        "layoutmap-mesh",
        lambda: LayoutMap(M, {"k": Layout(PERM, P("dp"))}),
        LayoutError,
        "not this map's Mesh(dp=2, tp=4)",
    ),
    ("layoutmap-path", lambda: LayoutMap(M, {}).get(3), LayoutError, "take a str path, got 3"),
    (
        "axisrules-pair",
        lambda: AxisRules([("batch",)]),
        LayoutError,
        "axis rule ('batch',) is not a (logical name, mesh axes) pair",
    ),
    (
        "axisrules-name",
        lambda: AxisRules([(3, "dp")]),
        LayoutError,
        "logical axis name 3 must be a non-empty str",
    ),
    (
        "axisrules-target",
        lambda: AxisRules([("batch", 3)]),
        LayoutError,
        "rule for 'batch': 3 (int) is not a spec entry",
    ),
    (
        "axisrules-spec-str",
        lambda: AxisRules([]).spec("batch"),
        LayoutError,
        "logical_axes must be a tuple",
    ),
    # found by the second independent audit (issue 17)
    (
        "layoutmap-regex-repeat",
        lambda: LayoutMap(M, {"a{1001}": P()}),
        LayoutError,
        "LayoutMap key 'a{1001}' is not a regex unimesh can match (invalid repetition size",
    ),
    (
        "layoutmap-regex-lookahead",
        lambda: LayoutMap(M, {"(?=a)a": P()}),
        LayoutError,
        "it uses a lookahead or lookbehind ((?=...)",
    ),
    (
        "layoutmap-regex-double-star",
        lambda: LayoutMap(M, {"a**": P()}),
        LayoutError,
        "LayoutMap key 'a**' is not a regex unimesh can match: Python's re refuses it: multiple",
    ),
    (
        "layoutmap-key-surrogate",
        lambda: LayoutMap(M, {"w\ud800": P()}),
        LayoutError,
        "LayoutMap key 'w\\ud800' is not valid Unicode text (character 1 is a lone surrogate)",
    ),
    (
        "layoutmap-path-surrogate",
        lambda: LayoutMap(M, {"w.*": P()}).get("w\udc00"),
        LayoutError,
        "LayoutMap path 'w\\udc00' is not valid Unicode text",
    ),
    (
        "mesh-65-axes",
        lambda: Mesh((1,) * 65, tuple(f"a{i}" for i in range(65))),
        MeshSpecError,
        "a mesh of 65 axes is more than unimesh supports (64, numpy's limit",
    ),
    (
        "mesh-201-axes",
        lambda: Mesh.from_string(",".join(f"a{i}=1" for i in range(201))),
        MeshSpecError,
        "a mesh of 201 axes is more than unimesh supports",
    ),
    (
        "mesh-dpp-huge",
        lambda: Mesh((2,), ("a",), devices_per_process=10**30),
        MeshSpecError,
        "devices_per_process must be <= 67108864, got 1000000000000000000000000000000",
    ),
    (
        "make-mesh-dpp-huge",
        lambda: make_mesh({"a": 2}, dcn_axes={"a": -1}, num_devices=2, devices_per_process=2**70),
        MeshSpecError,
        "devices_per_process must be <= 67108864",
    ),
    (
        "mesh-shape-range-1e18",
        lambda: Mesh(range(10**18), ("a",)),
        MeshSpecError,
        "mesh shape has more than 1048576 entries (range(0, 1000000000000000000)); a mesh has at",
    ),
    (
        "mesh-shape-range-beyond-maxsize",
        lambda: Mesh((2,), range(10**20)),
        MeshSpecError,
        "axis_names has more than 1048576 entries (range(0, 100000000000000000000))",
    ),
    (
        "mesh-shape-endless-iterator",
        lambda: Mesh(iter(int, 1), ("a",)),
        MeshSpecError,
        "mesh shape has more than 1048576 entries (<callable_iterator",
    ),
    (
        "mesh-names-0d-array",
        lambda: Mesh((2,), np.array(2)),
        MeshSpecError,
        "axis_names must be a tuple or list, got array(2) (ndarray)",
    ),
    (
        "coords-2-63",
        lambda: M.coords(2**63),
        MeshSpecError,
        "device ids 9223372036854775808 are out of range",
    ),
    (
        "coords-2-70",
        lambda: M.coords(2**70),
        MeshSpecError,
        "device ids 1180591620717411303424 are out of range",
    ),
    (
        "mesh-text-unicode-digit",
        lambda: Mesh.from_string("dp=\u0662"),
        MeshSpecError,
        "cannot read axis 'dp=\u0662'",
    ),
    (
        "mesh-text-nbsp",
        lambda: Mesh.from_string("dp\u00a0=2"),
        MeshSpecError,
        "cannot read axis 'dp\\xa0=2'",
    ),
    (
        "distribute-strings",
        lambda: unimesh.distribute(np.array(["a", "b"]), Layout(M, P()), backend="nope"),
        unimesh.ConversionError,
        "distribute() lays out arrays of numbers or bools; got one of dtype <U1",
    ),
    (
        "distribute-objects",
        lambda: unimesh.distribute(np.array([object(), 1]), Layout(M, P()), backend="nope"),
        unimesh.ConversionError,
        "got one of dtype object",
    ),
    (
        "full-array-list",
        lambda: unimesh.full_array([1, 2], backend="nope"),
        unimesh.ConversionError,
        "full_array() takes a backend's distributed array",
    ),
]
