"""Hostile input: the parsers of mesh strings, mesh JSON/dicts and config files under a
mutation fuzzer (tests/support/fuzzing.py; benchmarks/fuzz.py runs 100,000+ inputs)."""

from __future__ import annotations

import os

import pytest

import unimesh
from unimesh import Config, Mesh

from .support import fuzzing

COUNT = int(os.environ.get("UNIMESH_FUZZ_COUNT", "3000"))


def test_fuzzed_inputs_give_results_or_unimesh_errors():
    report = fuzzing.run(COUNT, seed=1234)
    assert report.count == COUNT
    assert not report.failures, "\n".join(report.failures[:20])
    assert set(report.by_target) == {
        "Mesh.from_string",
        "Mesh.from_json",
        "Mesh.from_dict",
        "Config.from_toml",
        "Config.from_json",
        "Config.from_dict",
    }
    assert report.accepted > COUNT // 50 and sum(report.refused.values()) > COUNT // 2, report
    # a guard against pathological inputs (seconds), not a performance claim: the 50 ms
    # figure is measured by benchmarks/fuzz.py
    assert report.slowest_ms < 2000, (report.slowest_ms, report.slowest)


def test_memory_stays_small_under_hostile_sizes():
    report = fuzzing.run(300, seed=99, memory=True)
    assert not report.failures, report.failures[:5]
    assert report.peak_bytes < 64 * 2**20, (report.peak_bytes, report.peak_input)


@pytest.mark.parametrize(
    "parse, value",
    [
        (Mesh.from_string, "a=1000000,b=1000000"),
        (Mesh.from_string, "a=1000000000000"),
        (Mesh.from_json, '{"axis_names": ["a", "b"], "shape": [1000000, 1000000]}'),
        (Mesh.from_dict, {"axis_names": ["a"], "shape": [10**12], "device_ids": [0]}),
        (Config.from_toml, "[mesh]\naxes = {a = 1000000, b = 1000000}"),
        (Config.from_json, '{"mesh": "a=1000000000000"}'),
    ],
)
def test_a_trillion_devices_is_an_error_before_any_allocation(parse, value):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(unimesh.MeshSpecError, match="1000000"):
            parse(value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak


def test_the_audit_hook_would_see_an_evaluation():
    """The fuzzer's watch is real: an eval() while a parser runs is reported."""
    fuzzing._install_hook()
    fuzzing._WATCH["on"], fuzzing._WATCH["seen"] = True, []
    try:
        eval("1 + 1")
    finally:
        fuzzing._WATCH["on"] = False
    assert "exec" in fuzzing._WATCH["seen"] or "compile" in fuzzing._WATCH["seen"]
