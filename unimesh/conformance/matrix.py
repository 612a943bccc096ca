"""The capability matrix: what each case of the suite ended as, merged one way, rendered one way.

A case is one test run for one backend, attributed to one capability. It ends as one of
:data:`OUTCOMES`:

- ``passed``: checked against the core's reference;
- ``failed``: it disagreed or raised;
- ``refused``: the backend declares the capability but refused this case with
  ``UnsupportedError`` (e.g. a mesh it cannot express);
- ``skipped``: it could not run here (too few devices, a mesh with too few axes);
- ``refusal checked``: the capability is not declared and the backend refused it, as it must;
- ``undeclared``: a test of a capability the backend does not declare, not run.

A capability's verdict follows from its cases: ``fail`` if any failed; else ``not declared`` if
the backend does not declare it (its refusal checked); else ``refused`` if any case was refused,
``pass`` if some passed, ``skipped`` if none could run. A run
in several processes merges case by case, keeping the worst outcome of each case.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import CHECKED

__all__ = ["OUTCOMES", "Case", "Cell", "markdown", "merge", "text_rows", "verdict_legend"]

#: Case outcomes, worst first (the merge keeps the worst outcome of a case across processes).
OUTCOMES = ("failed", "refused", "skipped", "passed", "refusal checked", "undeclared")

#: What each verdict means, for the legends of every rendering.
VERDICTS = {
    "pass": "every case that ran passed",
    "fail": "a case failed",
    "refused": "declared; cases it cannot express refused by name, not failed",
    "skipped": "declared, but no case could run here",
    "not declared": "not declared; the backend refuses it, as checked",
}

#: How many reasons a cell keeps (the first of each distinct kind).
REASONS = 3


@dataclass(frozen=True)
class Case:
    """One test of one backend: its id (without the process), capability, outcome and why."""

    backend: str
    capability: str
    test: str
    outcome: str
    why: str = ""

    def to_json(self) -> list[str]:
        return [self.backend, self.capability, self.test, self.outcome, self.why]

    @classmethod
    def from_json(cls, row: Iterable[Any]) -> Case:
        backend, capability, test, outcome, why = (str(v) for v in row)
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown case outcome {outcome!r}; known: {OUTCOMES}")
        return cls(backend, capability, test, outcome, why)


@dataclass
class Cell:
    """One capability of one backend: how many cases ended each way, and why some did not
    pass."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    reasons: list[str] = field(default_factory=list)
    skips: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        c = self.counts
        if c["failed"]:
            return "fail"
        if c["refusal checked"] or c["undeclared"]:
            return "not declared"
        if c["refused"]:
            return "refused"
        if c["passed"]:
            return "pass"
        return "skipped" if c["skipped"] else "-"

    def notes(self) -> list[str]:
        """Why the cell is not a plain pass: failures and refusals, or why nothing ran."""
        return self.reasons + (self.skips if self.verdict == "skipped" else [])

    @property
    def ran(self) -> int:
        """Cases that ran to an answer (passed, failed or refused)."""
        return self.counts["passed"] + self.counts["failed"] + self.counts["refused"]

    def summary(self) -> str:
        """The verdict with its counts: ``pass 14``, ``refused 3/14``, ``fail 1/14``."""
        v, c = self.verdict, self.counts
        if v == "pass":
            return f"pass {c['passed']}"
        if v == "fail":
            return f"fail {c['failed']}/{self.ran}"
        if v == "refused":
            return f"refused {c['refused']}/{self.ran}"
        return v

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            **self.counts,
            "reasons": list(self.reasons),
            "skips": list(self.skips),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cell:
        return cls(
            {k: int(data.get(k, 0)) for k in OUTCOMES},
            list(data.get("reasons", [])),
            list(data.get("skips", [])),
        )


def merge(cases: Iterable[Case]) -> dict[str, dict[str, Cell]]:
    """backend -> capability -> :class:`Cell`, from the cases of every process of a run: a case
    reported by several processes counts once, as its worst outcome."""
    worst: dict[tuple[str, str, str], Case] = {}
    for case in cases:
        key = (case.backend, case.capability, case.test)
        have = worst.get(key)
        if have is None or OUTCOMES.index(case.outcome) < OUTCOMES.index(have.outcome):
            worst[key] = case
    out: dict[str, dict[str, Cell]] = {}
    for case in sorted(worst.values(), key=lambda c: c.test):
        cell = out.setdefault(case.backend, {}).setdefault(case.capability, Cell())
        cell.counts[case.outcome] += 1
        kept = cell.reasons if case.outcome in ("failed", "refused") else cell.skips
        if case.outcome in ("failed", "refused", "skipped") and case.why:
            why = f"{case.outcome}: {case.why}"
            if why not in kept and len(kept) < REASONS:
                kept.append(why)
    return out


def text_rows(columns: Mapping[str, Mapping[str, Cell]]) -> list[tuple[str, list[str]]]:
    """(capability, a cell summary per column) in :data:`CHECKED` order: what every rendering
    of the matrix (terminal, rich, Markdown) shows."""
    return [
        (cap, [m[cap].summary() if cap in m else "-" for m in columns.values()]) for cap in CHECKED
    ]


def verdict_legend() -> str:
    return "; ".join(f"{v}: {what}" for v, what in VERDICTS.items())


def markdown(columns: Mapping[str, Mapping[str, Cell]]) -> str:
    """The matrix as Markdown: a row per capability, a column per backend (``columns`` keys
    are the column titles), then the reasons for every cell that is not a plain pass."""
    head = ["capability", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for cap, cells in text_rows(columns):
        lines.append(f"| {cap} | " + " | ".join(cells) + " |")
    lines += ["", f"Counts are cases. {verdict_legend()}."]
    notes = [
        (title, cap, why)
        for title, m in columns.items()
        for cap in CHECKED
        if cap in m
        for why in m[cap].notes()
    ]
    if notes:
        lines.append("")
        for title, cap, why in notes:
            lines.append(f"- {title}, {cap}: {why.replace('|', '/')}")
    return "\n".join(lines) + "\n"
