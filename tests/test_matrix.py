"""The capability matrix's one merge rule and one renderer (unimesh.conformance.matrix): a
declared capability with a refused or failed case is never "pass", and a case seen by several
processes counts once, as its worst outcome."""

from __future__ import annotations

import pytest

from unimesh.conformance.matrix import Case, Cell, markdown, merge


def case(test: str, outcome: str, cap: str = "layout", why: str = "") -> Case:
    return Case("be", cap, test, outcome, why)


def test_one_refused_case_makes_a_declared_capability_refused_not_pass():
    cell = merge(
        [
            case("a", "passed"),
            case("b", "passed"),
            case("c", "refused", why="meshes whose ranks are not increasing"),
        ]
    )["be"]["layout"]
    assert cell.verdict == "refused" and cell.summary() == "refused 1/3"
    assert cell.notes() == ["refused: meshes whose ranks are not increasing"]


def test_a_failed_case_wins_over_everything():
    cell = merge(
        [case("a", "passed"), case("b", "refused", why="x"), case("c", "failed", why="boom")]
    )["be"]["layout"]
    assert cell.verdict == "fail" and cell.summary() == "fail 1/3"
    assert cell.notes() == ["refused: x", "failed: boom"]


def test_processes_merge_case_by_case_keeping_the_worst():
    rank0 = [case("a", "passed"), case("b", "passed")]
    rank1 = [case("a", "passed"), case("b", "failed", why="rank 1 disagrees")]
    cell = merge(rank0 + rank1)["be"]["layout"]
    assert cell.counts["passed"] == 1 and cell.counts["failed"] == 1  # each case once
    assert cell.verdict == "fail"


def test_undeclared_capabilities_and_skips():
    m = merge(
        [
            case("r", "refusal checked", cap="partial"),
            case("t", "undeclared", cap="partial"),
            case("s", "skipped", cap="grad", why="needs 8 devices"),
            case("p", "passed", cap="mesh"),
            case("q", "skipped", cap="mesh", why="n/a"),
        ]
    )
    assert m["be"]["partial"].verdict == "not declared"
    assert m["be"]["grad"].verdict == "skipped" and m["be"]["grad"].notes() == [
        "skipped: needs 8 devices"
    ]
    assert m["be"]["mesh"].verdict == "pass" and m["be"]["mesh"].notes() == []


def test_markdown_shows_counts_and_reasons_and_round_trips_through_json():
    m = merge([case("a", "passed"), case("b", "refused", why="a | b")])
    again = {"be (4 processes)": {c: Cell.from_json(cell.to_json()) for c, cell in m["be"].items()}}
    text = markdown(again)
    assert text.splitlines()[0] == "| capability | be (4 processes) |"
    assert "| layout | refused 1/2 |" in text and "| mesh | - |" in text
    assert "- be (4 processes), layout: refused: a / b" in text


def test_unknown_outcomes_are_refused():
    with pytest.raises(ValueError, match="unknown case outcome 'great'"):
        Case.from_json(["be", "mesh", "t", "great", ""])
