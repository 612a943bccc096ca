"""Hostile input from the grammars (tests/support/grammar.py): hypothesis builds mesh text, mesh
JSON, mesh dicts, config TOML, config JSON and config dicts production by production, with hostile
alternatives at each; every input must give a result that round-trips or a UnimeshError with a
message. benchmarks/fuzz.py runs the same families at 100,000 inputs each."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings

import unimesh
from unimesh import Config, Mesh

from .support import grammar

COUNT = int(os.environ.get("UNIMESH_GRAMMAR_COUNT", "250"))
_SETTINGS = settings(
    max_examples=COUNT, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@_SETTINGS
@given(grammar.mesh_texts())
@example("|x=2|0,1|0,1|/device:CPU:\u00b2,/device:CPU:1")  # a superscript digit: ValueError once
@example("dp=\u0662")  # Unicode digits are refused, not read as 2
@example("dp\u00a0=2")
@example(",".join(f"a{i}=1" for i in range(65)) + ";ids=0")
def test_mesh_text(text: str) -> None:
    grammar.check(Mesh.from_string, text)


@_SETTINGS
@given(grammar.mesh_jsons())
def test_mesh_json(text: str) -> None:
    grammar.check(Mesh.from_json, text)


@_SETTINGS
@given(grammar.mesh_dicts())
@example({"axis_names": np.array(2), "shape": [1]})
@example({"axis_names": ["a"], "shape": [1], "devices_per_process": 10**30})
def test_mesh_dict(d: object) -> None:
    grammar.check(Mesh.from_dict, d)


@_SETTINGS
@given(grammar.config_tomls())
@example('mesh = "a=1"\nx = ' + "9" * 5000)  # tomllib's ValueError for a long integer
@example('mesh = "a=1"\n[layout]\n"a{4294967296}" = "a"')
def test_config_toml(text: str) -> None:
    grammar.check(Config.from_toml, text)


@_SETTINGS
@given(grammar.config_jsons())
def test_config_json(text: str) -> None:
    grammar.check(Config.from_json, text)


@_SETTINGS
@given(grammar.config_dicts())
@example({"mesh": "a=2", "layout": {"(" * 1000 + ")" * 1000: "a"}})
@example({"mesh": "a=2", "axis_rules": {"batch": "None"}})
def test_config_dict(d: object) -> None:
    grammar.check(Config.from_dict, d)


def test_the_grammars_reach_past_the_first_error() -> None:
    """The strategies are near enough to the grammars that a good share of each family parses
    (a fuzzer whose every input fails at the first character tests one error message)."""
    for family in grammar.FAMILIES:
        run = grammar.drive(family, 200, seed=7)
        assert run.count == 200 and not run.failures, run.failures[:3]
        assert run.outcomes.get("accepted", 0) >= 20, (family, run.outcomes)
        assert len(run.outcomes) >= 2, (family, run.outcomes)


def test_the_property_catches_a_foreign_exception() -> None:
    """check() is not vacuous: a parser raising ValueError, or an accepted mesh that does not
    round-trip, is reported."""

    def bad(_: object) -> object:
        raise ValueError("boom")

    with pytest.raises(AssertionError, match="ValueError: boom"):
        grammar.check(bad, "x")
    with pytest.raises(AssertionError, match="no message"):
        grammar.check(lambda _: (_ for _ in ()).throw(unimesh.MeshSpecError("  ")), "x")


def test_the_property_catches_a_parser_that_evaluates() -> None:
    """check() watches audit events: a parser that evaluates its input is reported, whether it
    then returns or raises a UnimeshError."""

    def evaluating(text: object) -> object:
        return Mesh.from_string(str(eval(str(text))))

    def evaluating_then_refusing(text: object) -> object:
        eval(str(text))
        raise unimesh.MeshSpecError("refused")

    with pytest.raises(AssertionError, match=r"triggered \['exec'|triggered \['compile'"):
        grammar.check(evaluating, "'dp=2'")
    with pytest.raises(AssertionError, match="triggered"):
        grammar.check(evaluating_then_refusing, "1")
    assert grammar.check(Mesh.from_string, "dp=2") == "accepted"


# -- checkpoints (issue 37): manifests, safetensors headers, DCP .metadata pickles ------------
@pytest.mark.parametrize("family", ["checkpoint manifest", "safetensors header", "dcp metadata"])
def test_checkpoint_readers(family: str) -> None:
    """Every generated input gives a result or a CheckpointError with a message, evaluates
    nothing, and a part of them is accepted (the grammar reaches the valid path)."""
    run = grammar.drive(family, COUNT, seed=37)
    assert not run.failures, run.failures[:3]
    assert run.count == COUNT
    assert run.outcomes.get("accepted", 0) > 0, run.outcomes
    assert set(run.outcomes) <= {"accepted", "CheckpointError"}, run.outcomes


def test_mutations_of_real_checkpoints() -> None:
    """A unimesh save's manifest and data file (and torch's own DCP files where torch is
    installed), mutated byte by byte, opened and read: a result or a CheckpointError."""
    from .support.checkpoint_grammar import mutate_checkpoints

    run = mutate_checkpoints(max(200, COUNT), seed=37)
    assert not run.failures, run.failures[:3]
    assert all(key.endswith(("accepted", "CheckpointError")) for key in run.outcomes), run.outcomes
