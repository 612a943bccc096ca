"""A mutation fuzzer for unimesh's parsers of untrusted text and data: Mesh.from_string /
from_json / from_dict and Config.from_toml / from_json / from_dict (load_config reads files
into these). Used by tests/test_fuzz.py (a few thousand inputs) and benchmarks/fuzz.py
(100,000 and more).

Every input must give a result or a ``UnimeshError``; nothing may be evaluated, compiled,
unpickled or run (an audit hook watches while a parser runs); the time and the memory peak of
each input are recorded.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import unimesh
from unimesh import Config, Mesh

#: Audit events that must never happen inside a parser.
FORBIDDEN = (
    "exec",
    "compile",
    "pickle.find_class",
    "marshal.loads",
    "os.system",
    "subprocess.Popen",
    "os.exec",
    "os.posix_spawn",
    "ctypes.dlopen",
)

TEXT_SEEDS = [
    "dp=2,tp=4",
    "a=1",
    "dp=2,tp=2;ids=3,2,1,0",
    "x=2,y=3;types=explicit,auto",
    "dp=4;per_process=2",
    "a=2,b=2,c=2;ids=7,6,5,4,3,2,1,0;types=auto,auto,manual;per_process=4",
    (
        "|x=2,y=2|0,1,2,3|0,1,2,3|/job:localhost/replica:0/task:0/device:CPU:0,"
        "/job:localhost/replica:0/task:0/device:CPU:1,/job:localhost/replica:0/task:0/device:CPU:2,"
        "/job:localhost/replica:0/task:0/device:CPU:3"
    ),
]
TOML_SEEDS = [
    (
        'mesh = "dp=2,tp=4"\nbatch_axis = "dp"\n[layout]\n"enc/.*/kernel" = "_,tp"\n'
        '"enc/.*/bias" = ["tp"]\n[axis_rules]\nbatch = "dp"\nmlp = "tp"\n'
    ),
    "[mesh]\naxes = {a = 2, b = 2}\ndevice_ids = [[3, 2], [1, 0]]\n",
    'mesh = "x=8"\n[layout]\n".*" = [["x"]]\n',
]
HUGE = [
    "1000000000000",
    "99999999999999999999",
    str(10**100),
    "-1",
    "0",
    "-0",
    "1e12",
    "2.5",
    "NaN",
    "Infinity",
    "4294967296",
    "18446744073709551617",
]
ALPHABET = "=,;|_+-.:[]{}\"'\\ \n\t0123456789abcdefxyz()*?^$#@!~`é\u0000\u202e"


def _json_seeds() -> list[Any]:
    meshes = [Mesh.from_string(s) for s in TEXT_SEEDS[:6]]
    out: list[Any] = [m.to_dict() for m in meshes]
    out += [Config.from_toml(t).to_dict() for t in TOML_SEEDS]
    return out


@dataclass
class Report:
    """What a fuzzing run saw."""

    count: int = 0
    accepted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    slowest_ms: float = 0.0
    slowest: str = ""
    peak_bytes: int = 0
    peak_input: str = ""
    by_target: dict[str, int] = field(default_factory=dict)


_WATCH = {"on": False, "seen": []}  # type: dict[str, Any]


def _importing() -> bool:
    """Whether the event comes from Python importing a module (a parser's first use may import
    a module of unimesh, or RE2, lazily; pytest rewrites some on the way): importlib's frames
    are on the stack. A parser that evaluates text has none."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _WATCH["on"] and event.startswith(FORBIDDEN) and not _importing():
        _WATCH["seen"].append(event)


_HOOKED = [False]


def _install_hook() -> None:
    if not _HOOKED[0]:
        sys.addaudithook(_audit)  # permanent, but silent unless a parser is running
        _HOOKED[0] = True


@contextlib.contextmanager
def watching() -> Iterator[list[str]]:
    """The FORBIDDEN audit events raised inside the block (the list fills as they happen)."""
    _install_hook()
    _WATCH["on"], _WATCH["seen"] = True, []
    try:
        yield _WATCH["seen"]
    finally:
        _WATCH["on"] = False


def mutate_text(rng: random.Random, text: str) -> str:
    ops = rng.randint(1, 4)
    for _ in range(ops):
        op = rng.randrange(9)
        pos = rng.randint(0, len(text))
        if op == 0 and text:
            text = text[:pos] + text[pos + 1 :]
        elif op == 1:
            text = text[:pos] + rng.choice(ALPHABET) + text[pos:]
        elif op == 2:
            text = text[:pos] + rng.choice(HUGE) + text[pos:]
        elif op == 3 and text:  # duplicate a chunk (repetition, long ids lists)
            a = rng.randint(0, len(text) - 1)
            chunk = text[a : a + rng.randint(1, 20)]
            text = text[:pos] + chunk * rng.choice([2, 10, 1000]) + text[pos:]
        elif op == 4:
            text = (
                text[:pos]
                + rng.choice(
                    ["[" * 500, "{" * 200, '"' * 50, ";ids=" * 20, "=" * 100, ",,,,", "a" * 5000]
                )
                + text[pos:]
            )
        elif op == 5:  # splice with another seed
            other = rng.choice(TEXT_SEEDS + TOML_SEEDS)
            text = text[:pos] + other[rng.randint(0, len(other)) :]
        elif op == 6:
            text = "".join(
                c if not c.isdigit() or rng.random() > 0.3 else rng.choice("09") for c in text
            )
        elif op == 7:
            text = (
                text[:pos]
                + "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 30)))
                + text[pos:]
            )
        else:
            text = text.replace(rng.choice("=,;"), rng.choice(["", "==", ";", ",", "|"]), 1)
    return text


def mutate_value(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """A JSON-like value, some part of it replaced by something hostile."""
    hostile = [
        None,
        True,
        -1,
        0,
        10**12,
        10**100,
        2.5,
        float("nan"),
        "",
        "x" * 10_000,
        [],
        {},
        [[[[[]]]]],
        {"a": {"b": {"c": {}}}},
        ["dp", "dp"],
        [10**6] * 8,
        list(range(5000)),
        "dp=2",
        {"__class__": "os.system"},
        ["_", None],
    ]
    if depth > 3 or rng.random() < 0.2:
        return rng.choice(hostile)
    if isinstance(value, dict) and value:
        out = dict(value)
        key = rng.choice(list(out))
        if rng.random() < 0.15:
            out[rng.choice(["extra", "__reduce__", "", "mesh", "axes", "shape"])] = rng.choice(
                hostile
            )
        elif rng.random() < 0.1:
            del out[key]
        else:
            out[key] = mutate_value(rng, out[key], depth + 1)
        return out
    if isinstance(value, list) and value:
        out_list = list(value)
        i = rng.randrange(len(out_list))
        out_list[i] = mutate_value(rng, out_list[i], depth + 1)
        if rng.random() < 0.1:
            out_list = out_list * rng.choice([2, 100])
        return out_list
    return rng.choice(hostile)


def inputs(seed: int) -> Iterator[tuple[str, Callable[[Any], Any], Any]]:
    """An endless, reproducible stream of (target name, parser, input)."""
    rng = random.Random(seed)
    dicts = _json_seeds()
    while True:
        kind = rng.randrange(7)
        if kind == 0:
            yield "Mesh.from_string", Mesh.from_string, mutate_text(rng, rng.choice(TEXT_SEEDS))
        elif kind == 1:
            yield (
                "Mesh.from_json",
                Mesh.from_json,
                mutate_text(rng, json.dumps(rng.choice(dicts[:6]))),
            )
        elif kind == 2:
            yield "Mesh.from_dict", Mesh.from_dict, mutate_value(rng, rng.choice(dicts[:6]))
        elif kind == 3:
            yield "Config.from_toml", Config.from_toml, mutate_text(rng, rng.choice(TOML_SEEDS))
        elif kind == 4:
            yield (
                "Config.from_json",
                Config.from_json,
                mutate_text(rng, json.dumps(rng.choice(dicts[6:]))),
            )
        elif kind == 5:
            yield "Config.from_dict", Config.from_dict, mutate_value(rng, rng.choice(dicts[6:]))
        else:  # not even close: random bytes of text
            n = rng.choice([0, 1, 5, 50, 500])
            text = "".join(rng.choice(ALPHABET) for _ in range(n))
            target = rng.choice(
                [
                    ("Mesh.from_string", Mesh.from_string),
                    ("Config.from_toml", Config.from_toml),
                    ("Config.from_json", Config.from_json),
                ]
            )
            yield target[0], target[1], text


def run(
    count: int, seed: int = 0, memory: bool = False, progress: Callable[[int], None] | None = None
) -> Report:
    """Feed ``count`` inputs; with ``memory``, also trace each input's allocation peak."""
    for text in TEXT_SEEDS:  # warm up: lazy imports of the parsers' own modules happen here
        Mesh.from_string(text)
    for text in TOML_SEEDS:
        Config.from_json(Config.from_toml(text).to_json())
    _install_hook()
    report = Report()
    stream = inputs(seed)
    if memory:
        tracemalloc.start()
    try:
        for i in range(count):
            name, parse, value = next(stream)
            report.by_target[name] = report.by_target.get(name, 0) + 1
            if memory:
                tracemalloc.reset_peak()
            _WATCH["on"], _WATCH["seen"] = True, []
            t0 = time.perf_counter()
            try:
                parse(value)
                report.accepted += 1
            except unimesh.UnimeshError as exc:
                report.refused[type(exc).__name__] = report.refused.get(type(exc).__name__, 0) + 1
            except BaseException as exc:  # noqa: BLE001 - the finding itself
                report.failures.append(
                    f"{name}({_show(value)}) raised {type(exc).__name__}: {str(exc)[:200]}"
                )
            finally:
                ms = (time.perf_counter() - t0) * 1e3
                _WATCH["on"] = False
            if _WATCH["seen"]:
                report.failures.append(f"{name}({_show(value)}) triggered {_WATCH['seen'][:3]}")
            if ms > report.slowest_ms:
                report.slowest_ms, report.slowest = ms, f"{name}({_show(value)})"
            if memory:
                peak = tracemalloc.get_traced_memory()[1]
                if peak > report.peak_bytes:
                    report.peak_bytes, report.peak_input = peak, f"{name}({_show(value)})"
            report.count += 1
            if progress is not None and i % 1000 == 0:
                progress(i)
    finally:
        if memory:
            tracemalloc.stop()
    return report


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:100] + f"... ({len(text)} chars)"
