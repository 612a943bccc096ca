"""Hypothesis strategies built from the grammars of unimesh's untrusted inputs, and a driver that
feeds them to the parsers.

The families: mesh text (``"dp=2,tp=4;ids=...;types=...;per_process=k"`` and TF DTensor's
``name|dims|global ids|local ids|devices``), mesh JSON, mesh dicts (Python objects for
``Mesh.from_dict``), config TOML, config JSON and config dicts. Each strategy follows its
grammar's productions, and at every production may take a hostile alternative instead (huge
and negative numbers, Unicode digits and spaces, reserved names, wrong types, deep nesting,
regexes that are invalid or that backtrack exponentially elsewhere), so most inputs are close
to valid and reach deep into the parsers, unlike the byte-level mutations of ``fuzzing.py``.

``check(family, value)`` is the property: a result or a ``UnimeshError`` naming the value,
never another exception, and an accepted value survives its own round trip (``to_string``,
``to_json``). ``drive`` runs a family under hypothesis for ``tests/test_grammar_fuzz.py`` and
``benchmarks/fuzz.py``, recording the outcome classes, the slowest input and the largest
memory peak.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import math
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import unimesh
from unimesh import Config, Mesh

from .fuzzing import _show, watching

# ---------------------------------------------------------------- lexical pieces

_IDENT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True)
HOSTILE_NAMES = [
    "None", "none", "_", "", " ", "dp ", "a b", "a-b", "1a", "é", "\u0662", "\u00a0dp",
    "ids", "types", "per_process", "x" * 300, "a\x00", "\u202e", "dp=2", "a,b", "a;b", "a|b",
]  # fmt: skip
NAMES = st.one_of(
    st.sampled_from(["dp", "tp", "pp", "ep", "fsdp", "x", "y", "data", "model"]),
    _IDENT,
    st.sampled_from(HOSTILE_NAMES),
    st.text(max_size=4),
)
HUGE_INTS = [0, -1, -(2**63), 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**18, 10**30]
SIZES = st.integers(1, 4)
HOSTILE_SIZES = st.one_of(st.sampled_from(HUGE_INTS), st.integers())
SIZE_TOKENS = [
    "\u0662", "\uff12", "2\u00a0", " 2 ", "+2", "0x10", "2.0", "1e3", "", "-1", "0002",
    "9" * 13, "9" * 20, "9" * 5000, "NaN", "2_0",
]  # fmt: skip


def _roll(draw: Any, n: int) -> int:
    """A draw from 0..n-1 for choosing among productions, with the value hypothesis favours
    (its smallest, 0) moved to the middle: branch 0, the hostile one by convention here, then
    comes about once in n rather than in a large share of the inputs."""
    return (draw(st.integers(0, n - 1)) + n // 2) % n


def _size_text(draw: Any) -> str:
    roll = _roll(draw, 16)
    if roll == 0:
        return draw(st.sampled_from(SIZE_TOKENS))
    return str(draw(HOSTILE_SIZES if roll == 1 else SIZES))


TYPES = st.one_of(
    st.sampled_from(["auto", "explicit", "manual"]),
    st.sampled_from(["Auto", "", " auto", "hidden", "x" * 100]),
    st.text(max_size=3),
)

# Regexes for layout keys: the productions of a small regex grammar, and the classic hostile
# ones (exponential backtracking elsewhere, deep nesting, huge counts, what RE2 does not take).
_REGEX_HOSTILE = [
    "(a+)+$", "(a|aa)*$", "(.*a){20}", "a{4294967296}", "a{1000}{1000}", "(" * 1000 + ")" * 1000,
    "(", "[", "\\", "a)", "(?P<x>a)(?P=x)", "(a)\\1", "(?<=a)b", "(?=a)", "(?#c)", "[z-a]",
    "\ud800", "(a)" * 500, "x{2,1}", "**", "\\p{Greek}+", "[[:alpha:]]",
]  # fmt: skip
_ATOMS = st.one_of(
    st.sampled_from(["enc", "dec", "kernel", "bias", "layer", "0", "dense"]),
    st.sampled_from([".*", ".+", "[a-z]+", "\\d+", "[^/]*", "(a|b)", "\\.", "."]),
)


@st.composite
def regexes(draw: Any) -> str:
    if _roll(draw, 6) == 0:
        return draw(st.sampled_from(_REGEX_HOSTILE))
    parts = draw(st.lists(_ATOMS, min_size=1, max_size=4))
    text = "/".join(parts)
    if draw(st.booleans()):
        text = f"({text}){draw(st.sampled_from(['*', '+', '?', '{2}', '{0,3}', '']))}"
    return text


# ---------------------------------------------------------------- meshes


def _valid_ids(draw: Any, size: int) -> list[int]:
    ids = draw(st.permutations(list(range(size))))
    if _roll(draw, 5) == 0:  # sparse, large ids (valid int64)
        ids = [i * draw(st.sampled_from([7, 10**6, 10**17])) for i in ids]
    return list(ids)


def _shape_size(sizes: list[str]) -> int | None:
    try:
        values = [int(s) for s in sizes]
    except ValueError:
        return None
    if not all(v > 0 for v in values):
        return None
    total = math.prod(values)
    return total if total <= 64 else None


@st.composite
def mesh_texts(draw: Any) -> str:
    """``name=size[,name=size...][;ids=...][;types=...][;per_process=k]`` or DTensor's form."""
    if _roll(draw, 8) == 0:
        return draw(dtensor_texts())
    big = _roll(draw, 10) == 0  # around the limits on axes: numpy's 64, JAX's 32
    k = draw(st.sampled_from([0, 32, 33, 64, 65, 200]) if big else st.integers(1, 3))
    names = [f"a{i}" for i in range(k)]
    if k and _roll(draw, 4) == 0:  # one drawn name (hostile ones included)
        names[draw(st.integers(0, k - 1))] = draw(NAMES)
    if k and _roll(draw, 8) == 0:  # a repeated name
        names[-1] = names[0]
    sizes = [_size_text(draw) for _ in range(k)] if k <= 4 else ["1"] * k
    eq = ["="] * k
    if k and _roll(draw, 8) == 0:
        eq[draw(st.integers(0, k - 1))] = draw(st.sampled_from([" = ", "==", ":", ""]))
    sep = draw(st.sampled_from([",", ", "] * 6 + [",,", " "]))
    head = sep.join(f"{n}{e}{z}" for n, e, z in zip(names, eq, sizes))
    size = _shape_size(sizes)
    sections = []
    if draw(st.booleans()):
        if size is not None and draw(st.integers(0, 3)):
            ids = [str(i) for i in _valid_ids(draw, size)]
        else:
            ids = [_size_text(draw) for _ in range(draw(st.integers(0, 5)))]
        sections.append("ids=" + ",".join(ids))
    if draw(st.booleans()):
        sections.append("types=" + ",".join(draw(TYPES) for _ in range(max(k, 1))))
    if draw(st.booleans()):
        per = draw(st.sampled_from([1, 2, 4])) if draw(st.booleans()) else None
        sections.append(f"per_process={per if per is not None else _size_text(draw)}")
    if _roll(draw, 10) == 0:
        sections.append(draw(st.sampled_from(["ids=0", "shape=2", "", "types", "=1"])))
    order = draw(st.permutations(sections))
    return ";".join([head, *order])


@st.composite
def dtensor_texts(draw: Any) -> str:
    """``name|dims|global ids|local ids|devices``, as TF DTensor's ``Mesh.to_string()``."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    size = math.prod(sizes)
    dims = ",".join(f"{draw(NAMES)}={s}" for s in sizes)
    glob = list(range(size)) if draw(st.integers(0, 3)) else draw(st.lists(st.integers(-1, 9)))
    local = glob if draw(st.booleans()) else draw(st.lists(st.sampled_from(glob or [0])))
    kind = draw(st.sampled_from(["CPU", "GPU", "TPU"]))
    index = st.one_of(st.integers(0, 99).map(str), st.sampled_from(["\u00b2", "\u0662", "", "x"]))
    devices = [f"/job:localhost/replica:0/task:0/device:{kind}:{draw(index)}" for _ in local]
    fields = [
        draw(st.sampled_from(["mesh", "", "|"])),
        dims,
        ",".join(map(str, glob)),
        ",".join(map(str, local)),
        ",".join(devices),
    ]
    return "|".join(fields[: draw(st.integers(3, 5))] if _roll(draw, 8) == 0 else fields)


def _nest(flat: list[Any], shape: list[int]) -> Any:
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0]
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


JSON_HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(HUGE_INTS + [10**100, -(10**100)]),
    st.text(max_size=4),
    st.just([]),
    st.just({}),
    st.recursive(st.integers(0, 3), lambda c: st.lists(c, max_size=3), max_leaves=8),
)
PY_HOSTILE = st.one_of(
    JSON_HOSTILE,
    st.sampled_from([float("nan"), float("inf"), b"dp", object(), (1, 2), {1, 2}, range(3)]),
    st.builds(lambda n: __import__("numpy").arange(n), st.integers(0, 3)),
    st.builds(lambda v: __import__("numpy").array(v), st.integers(0, 4)),
)


@st.composite
def mesh_dicts(draw: Any, hostile: Any = PY_HOSTILE) -> dict[Any, Any]:
    """The fields of ``Mesh.to_dict()``, each possibly replaced, dropped or joined by others."""
    k = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 4), min_size=k, max_size=k))
    d: dict[Any, Any] = {
        "axis_names": [draw(NAMES) if _roll(draw, 6) == 0 else f"a{i}" for i in range(k)],
        "shape": sizes,
    }
    if draw(st.booleans()):
        d["device_ids"] = _nest(_valid_ids(draw, math.prod(sizes)), sizes)
    if draw(st.booleans()):
        d["axis_types"] = [draw(TYPES) for _ in range(k)]
    if draw(st.booleans()):
        d["devices_per_process"] = draw(st.sampled_from([1, 2, 4]))
    roll = _roll(draw, 9)  # at most one hostile change, in a third of them
    key = draw(st.sampled_from(sorted(d)))
    if roll == 0:
        d[key] = draw(hostile)
    elif roll == 1:
        del d[key]
    elif roll == 2 and isinstance(d[key], list) and d[key]:
        d[key][draw(st.integers(0, len(d[key]) - 1))] = draw(hostile)
    elif roll == 3:
        d[draw(st.sampled_from(["extra", "mesh", "", "__class__", "shape "]))] = draw(hostile)
    return d


@st.composite
def mesh_jsons(draw: Any) -> str:
    """``Mesh.to_json()`` text of a JSON-able :func:`mesh_dicts`, sometimes damaged as text."""
    text = json.dumps(draw(mesh_dicts(JSON_HOSTILE)))
    return _damage(draw, text)


def _damage(draw: Any, text: str) -> str:
    roll = _roll(draw, 20)
    if roll == 0 and text:
        i = draw(st.integers(0, len(text) - 1))
        return text[:i] + text[i + 1 :]
    if roll == 1:
        i = draw(st.integers(0, len(text)))
        piece = draw(
            st.sampled_from(["[" * 2000, "NaN", "1e400", "\ud800", "\x00", ",", '"', "9" * 5000])
        )
        return text[:i] + piece + text[i:]
    if roll == 2:
        return text.replace(",", ",,", 1)
    return text


# ---------------------------------------------------------------- configs


SPEC_ENTRIES = st.one_of(
    st.none(),
    NAMES,
    st.lists(NAMES, max_size=2),
    st.sampled_from(["_", "None", "dp,tp", ["dp", "dp"], [["dp"]]]),
)


@st.composite
def spec_values(draw: Any) -> Any:
    if draw(st.booleans()):  # the text form "dp,_"
        return ",".join(
            draw(st.sampled_from(["dp", "tp", "_", "", "None", "x", "dp tp"]))
            for _ in range(draw(st.integers(0, 3)))
        )
    return draw(st.lists(SPEC_ENTRIES, max_size=3))


@st.composite
def config_dicts(draw: Any, hostile: Any = PY_HOSTILE, toml: bool = False) -> dict[Any, Any]:
    """The fields of ``Config.to_dict()``: ``mesh`` (text or table), ``layout`` (regex key ->
    spec), ``batch_axis``, ``axis_rules`` (logical name -> mesh axes or None)."""
    d: dict[Any, Any] = {}
    if _roll(draw, 16):
        if draw(st.booleans()):
            d["mesh"] = draw(mesh_texts())
        else:
            mesh = draw(mesh_dicts(JSON_HOSTILE))
            d["mesh"] = mesh if not toml else {k: v for k, v in mesh.items() if v is not None}
    if draw(st.booleans()):
        d["layout"] = draw(st.dictionaries(regexes(), spec_values(), max_size=4))
    if draw(st.booleans()):
        d["batch_axis"] = draw(st.one_of(NAMES, st.lists(NAMES, max_size=2)))
    if draw(st.booleans()):
        d["axis_rules"] = draw(
            st.dictionaries(
                NAMES, st.one_of(NAMES, st.lists(NAMES, max_size=2), st.none()), max_size=4
            )
        )
    roll = _roll(draw, 10)  # at most one hostile change, in a fifth of them
    if roll == 0 and d:
        d[draw(st.sampled_from(sorted(d)))] = draw(hostile)
    elif roll == 1:
        d[draw(st.sampled_from(["extra", "Mesh", "", "layouts"]))] = draw(hostile)
    return d


@st.composite
def config_jsons(draw: Any) -> str:
    return _damage(draw, json.dumps(draw(config_dicts(JSON_HOSTILE))))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else "nan"
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, dict):
        return (
            "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
        )
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    return '""'


@st.composite
def config_tomls(draw: Any) -> str:
    """TOML text: top-level keys, then ``[mesh]``/``[layout]``/``[axis_rules]`` tables."""
    d = draw(config_dicts(JSON_HOSTILE, toml=True))
    lines, tables = [], []
    for key, value in d.items():
        if isinstance(value, dict) and draw(st.booleans()):
            tables.append(f"[{json.dumps(str(key))}]")
            tables += [f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()]
        elif value is not None:
            lines.append(f"{json.dumps(str(key))} = {_toml_value(value)}")
    text = "\n".join(lines + tables) + "\n"
    if _roll(draw, 20) == 0:
        text += draw(st.sampled_from(["x = " + "9" * 5000, "[mesh]\n[mesh]", "a = [" * 300, "= 1"]))
    return _damage(draw, text)


# ---------------------------------------------------------------- the property and the driver


FAMILIES: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "mesh text": (mesh_texts, Mesh.from_string),
    "mesh json": (mesh_jsons, Mesh.from_json),
    "mesh dict": (mesh_dicts, Mesh.from_dict),
    "config toml": (config_tomls, Config.from_toml),
    "config json": (config_jsons, Config.from_json),
    "config dict": (config_dicts, Config.from_dict),
}


from .checkpoint_grammar import FAMILIES as _CHECKPOINT_FAMILIES

FAMILIES.update(_CHECKPOINT_FAMILIES)


def check(parse: Callable[[Any], Any], value: Any) -> str:
    """Parse ``value``: the outcome's class name ("accepted" or a UnimeshError's). Raises
    AssertionError for anything else, when an accepted value does not round-trip, or when the
    parser evaluated, compiled, unpickled or ran anything (fuzzing's audit hook)."""
    try:
        with watching() as seen:
            got = parse(value)
        if seen:
            raise AssertionError(f"parsing {_show(value)} triggered {seen[:3]}")
    except unimesh.UnimeshError as exc:
        if seen:
            raise AssertionError(f"parsing {_show(value)} triggered {seen[:3]}") from exc
        if not str(exc).strip():
            raise AssertionError(
                f"{type(exc).__name__} with no message for {_show(value)}"
            ) from exc
        return type(exc).__name__
    except AssertionError:
        raise
    except BaseException as exc:
        raise AssertionError(f"{type(exc).__name__}: {str(exc)[:300]} from {_show(value)}") from exc
    if isinstance(got, Mesh):
        assert Mesh.from_string(got.to_string()) == got, ("text round trip", _show(value))
        assert Mesh.from_json(got.to_json()) == got, ("JSON round trip", _show(value))
    elif isinstance(got, Config):
        assert Config.from_json(got.to_json()) == got, ("JSON round trip", _show(value))
    return "accepted"


@dataclass
class Run:
    """What one family's run saw."""

    family: str
    count: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    slowest_ms_per_100kb: float = 0.0
    slowest: str = ""
    peak_bytes: int = 0
    peak_input: str = ""
    seconds: float = 0.0


def drive(family: str, count: int, seed: int = 0, memory_every: int = 0) -> Run:
    """Feed ``count`` generated inputs of ``family`` to its parser (the generate phase of
    hypothesis only: no shrinking, no database); time each one, trace the allocation peak of
    every ``memory_every``-th (0: none), and collect failures instead of stopping."""
    strategy, parse = FAMILIES[family]
    run = Run(family)
    slow: list[tuple[float, int, Any, int]] = []  # the five slowest (ms per 100 KB), a heap

    @settings(
        max_examples=count,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy())
    def one(value: Any) -> None:
        traced = memory_every and run.count % memory_every == 0
        if traced:
            tracemalloc.start()
        t0 = time.perf_counter()
        try:
            outcome = check(parse, value)
        except AssertionError as exc:
            outcome = "failure"
            run.failures.append(str(exc)[:400])
        ms = (time.perf_counter() - t0) * 1e3
        if traced:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            if peak > run.peak_bytes:
                run.peak_bytes, run.peak_input = peak, _show(value)
        size = len(value) if isinstance(value, str) else len(repr(value))
        per = ms / max(1.0, size / 100_000)
        if not traced and (len(slow) < 5 or per > slow[0][0]):
            heapq.heappush(slow, (per, run.count, value, size))
            if len(slow) > 5:
                heapq.heappop(slow)
        run.outcomes[outcome] = run.outcomes.get(outcome, 0) + 1
        run.count += 1

    t0 = time.perf_counter()
    hypothesis.seed(seed)(one)()
    run.seconds = time.perf_counter() - t0
    for _, _, value, size in slow:  # timed again, best of 3: a pause of the machine or the
        best = min(_timed(parse, value) for _ in range(3))  # collector is not the input's
        per = best / max(1.0, size / 100_000)
        if per >= run.slowest_ms_per_100kb:
            run.slowest_ms_per_100kb = per
            run.slowest = f"{best:.2f} ms, {size:,} chars: {_show(value)}"
    return run


def _timed(parse: Callable[[Any], Any], value: Any) -> float:
    t0 = time.perf_counter()
    with contextlib.suppress(unimesh.UnimeshError):
        parse(value)
    return (time.perf_counter() - t0) * 1e3
