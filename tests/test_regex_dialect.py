"""LayoutMap keys mean what Python's ``re.fullmatch`` means (Keras matches them with it), though
unimesh matches them with RE2: a property test over generated keys and paths, non-ASCII
included, and the constructs refused by name (issue: wrong answers found by the frameworks' own
test suites, item 4)."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unimesh
from unimesh import LayoutMap, Mesh, P
from unimesh._pyregex import RegexRefused, to_re2

re2 = pytest.importorskip("re2")

# characters paths are made of: ASCII word and punctuation, Unicode letters and digits of
# several scripts, Unicode spaces and marks, superscripts (numeric but not decimal)
_CHARS = "aZz_09/.-: é ßЖжλΩ中文٣३²½\u00a0\u2003\u0301\u00b5ǅⅫ\t"
_paths = st.text(alphabet=_CHARS, max_size=8)

_ATOMS = [
    "a", "é", "Ж", "_", "/", "\\.", ".", "\\w", "\\W", "\\d", "\\D", "\\s", "\\S",
    "[a-z]", "[^/]", "[\\w.]", "[^\\W_]", "[\\d/]", "[é-ж]", "[^\\s]", "\\Z", "\\A", "^", "$",
    "\\u00e9", "\\x2f", "[\\S\\s]", "(?a:\\w)", "(?s:.)", "(?a:\\b)", "\\²",
]  # fmt: skip
_SUFFIX = ["", "*", "+", "?", "{2}", "{0,3}", "{1,}", "*?", "+?"]


@st.composite
def _keys(draw: st.DrawFn) -> str:
    def piece(depth: int) -> str:
        kind = draw(st.integers(0, 5 if depth < 2 else 2))
        if kind <= 2:
            body = draw(st.sampled_from(_ATOMS))
        elif kind == 3:
            body = "(" + "".join(piece(depth + 1) for _ in range(draw(st.integers(1, 3)))) + ")"
        elif kind == 4:
            body = "(?:" + "|".join(piece(depth + 1) for _ in range(draw(st.integers(2, 3)))) + ")"
        else:
            body = "(?a:" + piece(depth + 1) + ")"
        if body in ("^", "$", "\\A", "\\Z") or body.startswith("(?a:\\b") or depth > 0:
            return body  # no repeat inside a group: Python's re would backtrack exponentially
        return body + draw(st.sampled_from(_SUFFIX))

    prefix = draw(st.sampled_from(["", "", "(?a)", "(?s)", "(?m)"]))
    return prefix + "".join(piece(0) for _ in range(draw(st.integers(1, 4))))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=_keys(), paths=st.lists(_paths, min_size=1, max_size=6))
def test_keys_match_as_python_re_fullmatch_does(key: str, paths: list[str]) -> None:
    pattern = to_re2(key)  # the generator uses only constructs of the dialect
    compiled = re2.compile(pattern)
    for path in paths:
        want = re.fullmatch(key, path) is not None
        got = compiled.fullmatch(path) is not None
        assert got == want, (key, path, pattern[:200])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=_keys(), paths=st.lists(_paths, min_size=1, max_size=4))
def test_layout_map_lookup_agrees_with_python(key: str, paths: list[str]) -> None:
    """The whole LayoutMap path (exact keys first, then RE2 sets) against Keras's rule."""
    mesh = Mesh.from_string("a=2")
    lm = LayoutMap(mesh, {key: P("a")})
    for path in paths:
        want = path == key or re.fullmatch(key, path) is not None
        assert (lm.get(path) is not None) == want, (key, path)


def test_unicode_word_class_and_end_of_text() -> None:
    """The two cases the issue found: ``\\w`` misses non-ASCII letters; ``\\Z`` refused."""
    mesh = Mesh.from_string("a=2,b=2")
    lm = LayoutMap(mesh, {r"\w+/kernel": P("a"), r"head\Z": P("b")})
    assert lm.get("dénse/kernel") == unimesh.Layout(mesh, P("a"))
    assert re.fullmatch(r"\w+/kernel", "dénse/kernel")
    assert lm.get("head") == unimesh.Layout(mesh, P("b"))
    assert lm.get("dense/bias") is None


@pytest.mark.parametrize(
    ("key", "named"),
    [
        ("(?i)dense", "ignoring case"),
        ("(?i:d)ense", "ignoring case"),
        ("a(?=b)", "lookahead"),
        ("(?<!a)b", "lookbehind"),
        ("(a)\\1", "backreference"),
        ("(?P<x>a)(?P=x)", "backreference"),
        ("(a)?(?(1)b|c)", "conditional"),
        ("a++", "possessive"),
        ("(?>a)", "atomic group"),
        ("\\bdense", "\\b"),
        ("dense\\B", "\\b"),
        ("a{2000}", "repetition"),
        ("(", "Python's re refuses it"),
        ("\\w" * 200, "more than"),
    ],
)
def test_constructs_outside_the_dialect_are_refused_by_name(key: str, named: str) -> None:
    mesh = Mesh.from_string("a=2")
    with pytest.raises(unimesh.LayoutError) as info:
        LayoutMap(mesh, {key: P("a")})
    assert named in str(info.value)
    assert "LayoutMap key" in str(info.value)


def test_a_set_whose_dfa_runs_out_of_memory_still_answers() -> None:
    """RE2 sets answer "no match" when their DFA runs out of memory (no error is raised); the
    map notices (its always-matching sentinel is missing from the answer) and tries the keys
    one by one. The set here stands for one whose DFA failed: it answers nothing."""
    from unimesh.rules import _KeySet

    class FailedDfa:
        def Match(self, path: str) -> None:
            return None

    keys = [to_re2(r"\w+/kernel"), to_re2(r"\w+/bias")]
    assert _KeySet(FailedDfa(), keys).match("dénse/bias") == [1]
    real = re2.Set.FullMatchSet()
    for key in [*keys, "(?s:.*)"]:
        real.Add(key)
    real.Compile()
    assert _KeySet(real, keys).match("dénse/kernel") == [0]
    assert _KeySet(real, keys).match("dénse/other") == []


def test_a_path_with_a_line_break_is_refused_for_regex_keys() -> None:
    mesh = Mesh.from_string("a=2")
    lm = LayoutMap(mesh, {"dense$": P("a")})
    with pytest.raises(unimesh.LayoutError, match="line break"):
        lm.get("dense\n")
    assert lm.get("dense") is not None


def test_refused_translation_says_why() -> None:
    with pytest.raises(RegexRefused, match="lookahead"):
        to_re2("(?!x)y")
