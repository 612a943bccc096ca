"""Parameter-rule policies: which layout each parameter of a model gets. :class:`LayoutMap`
matches parameter paths (Keras' ``LayoutMap``); :class:`AxisRules` resolves logical axis names
(flax's ``logical_to_mesh_axes``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .layout import Layout
from .mesh import Mesh
from .messages import short
from .spec import Entry, PartitionSpec, _axes_of, _entry, _lfail

__all__ = ["AxisRules", "LayoutMap"]


def _pairs(rules: object, what: str, form: str) -> list[tuple[Any, Any]]:
    """A mapping or a sequence of pairs as a list of pairs."""
    if isinstance(rules, Mapping):
        return list(rules.items())
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        _lfail(f"{what}s must be a mapping or a list of {form} pairs, got {short(rules)}")
    out = []
    for pair in rules:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            _lfail(f"{what} {short(pair)} is not a {form} pair")
        out.append((pair[0], pair[1]))
    return out


_META = frozenset(".^$*+?{}[]\\|()")  # a key with none of these matches only itself
_CHUNK = 512  # regex keys per RE2 set: one pass over a path tests them all
_RE2_OPTIONS: Any = None


def _re2() -> tuple[Any, Any]:
    """The RE2 module and its options (errors raised, not also logged)."""
    global _RE2_OPTIONS
    import re2

    if _RE2_OPTIONS is None:
        _RE2_OPTIONS = re2.Options()
        _RE2_OPTIONS.log_errors = False
    return re2, _RE2_OPTIONS


def _is_regex(key: str) -> bool:
    """Whether ``key`` needs RE2 (False: a plain key, which only the exact lookup matches). A
    regex is parsed here, so a bad one is refused when the map is built. RE2 matches in time
    linear in the path whatever the pattern (Python's ``re`` backtracks exponentially on keys
    like ``(a+)+$``) and bounds nesting, repetition counts and program size; its syntax is
    Python's without lookaround or backreferences."""
    _utf8(key, "LayoutMap key")
    if not _META.intersection(key):
        return False
    re2, options = _re2()
    try:
        re2.Set.FullMatchSet(options).Add(key)  # parses only: cheap
    except re2.error:
        try:  # the set says only that it failed; a compile says why
            re2.compile(key, options)
            reason = "too large"
        except re2.error as exc:
            reason = exc.args[0] if exc.args else str(exc)
            if isinstance(reason, bytes):
                reason = reason.decode("utf-8", "replace")
        _lfail(
            f"LayoutMap key {short(key)} is not a regex unimesh can match ({reason[:120]}); "
            "keys are RE2 regexes: Python's syntax without lookaround or backreferences, "
            "repetition counts up to 1000"
        )
    return True


def _matchers(keys: list[str]) -> list[tuple[int, Any]]:
    """(offset, matcher) over ``keys`` in order: RE2 full-match sets of up to ``_CHUNK`` keys,
    or one compiled key where a set is too big to compile."""
    re2, options = _re2()
    out: list[tuple[int, Any]] = []
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start : start + _CHUNK]
        group = re2.Set.FullMatchSet(options)
        for key in chunk:
            group.Add(key)
        try:
            group.Compile()
            out.append((start, group))
        except re2.error:
            out.extend((start + i, re2.compile(key, options)) for i, key in enumerate(chunk))
    return out


def _utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        _lfail(
            f"{what} {short(text)} is not valid Unicode text (character {exc.start} is a lone "
            "surrogate); use a str that encodes as UTF-8"
        )


class LayoutMap:
    """Ordered mapping of variable-path patterns to layouts (``keras.distribution.LayoutMap``).

    Lookup follows Keras 3: an exact key wins; else every key is tried as a regex that must
    match the whole path (``fullmatch``); two matching keys are an error naming both; none
    gives None. Keys are matched by RE2 (Python's regex syntax without lookaround or
    backreferences), so a lookup takes time linear in the path whatever the keys.
    Values may be PartitionSpecs or tuples of entries and are validated against ``mesh``.
    """

    def __init__(
        self, mesh: Mesh, rules: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()
    ) -> None:
        if not isinstance(mesh, Mesh):
            _lfail(f"LayoutMap() needs a unimesh.Mesh, got {short(mesh)}")
        self._mesh = mesh
        self._rules: dict[str, Layout] = {}
        self._regexes: dict[str, None] = {}  # the keys that are regexes, in order
        self._matching: list[tuple[int, Any]] | None = None  # built by the first lookup
        for key, value in _pairs(rules, "LayoutMap rule", "(pattern, spec)"):
            self[key] = value

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            _lfail(f"LayoutMap keys are regex strings, got {short(key)}")
        self._set(key, value, _is_regex(key))

    def _set(self, key: str, value: Any, regex: bool) -> None:
        """``self[key] = value`` for a key already checked (``regex``: :func:`_is_regex`)."""
        if isinstance(value, Layout):
            if value.mesh is not self._mesh and value.mesh != self._mesh:
                _lfail(f"layout for {key!r} is on {value.mesh!r}, not this map's {self._mesh!r}")
            layout = value
        else:
            layout = Layout(self._mesh, value)
        self._rules[key] = layout
        if regex and key not in self._regexes:
            self._regexes[key] = None
            self._matching = None

    def __delitem__(self, key: str) -> None:
        del self._rules[key]
        if self._regexes.pop(key, 0) is None:
            self._matching = None

    def __getitem__(self, path: str) -> Layout | None:
        return self.get(path)

    def get(self, path: str) -> Layout | None:
        """The layout for a variable path, or None when no key matches."""
        if not isinstance(path, str):
            _lfail(f"LayoutMap lookups take a str path, got {short(path)}")
        if path in self._rules:
            return self._rules[path]
        _utf8(path, "LayoutMap path")
        keys = list(self._regexes)
        if self._matching is None:
            self._matching = _matchers(keys)
        hits = []
        for offset, matcher in self._matching:
            if hasattr(matcher, "fullmatch"):
                if matcher.fullmatch(path):
                    hits.append(keys[offset])
            else:
                hits.extend(keys[offset + i] for i in sorted(matcher.Match(path) or ()))
        if len(hits) > 1:
            _lfail(
                f"path {path!r} matches more than one LayoutMap key: {hits[0]!r} and "
                f"{hits[1]!r}; make the patterns exclusive"
            )
        return self._rules[hits[0]] if hits else None

    def __contains__(self, key: object) -> bool:
        return key in self._rules

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def items(self) -> list[tuple[str, Layout]]:
        return list(self._rules.items())

    def values(self) -> list[Layout]:
        return list(self._rules.values())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayoutMap):
            return NotImplemented
        return self._mesh == other._mesh and list(self._rules.items()) == list(other._rules.items())

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> dict[str, Any]:
        """Pickle and copy without the RE2 sets (they do not pickle; a lookup rebuilds them)."""
        return {**self.__dict__, "_matching": None}

    def __repr__(self) -> str:
        body = ", ".join(f"{k!r}: {v.spec!r}" for k, v in self._rules.items())
        return f"LayoutMap({self._mesh!r}, {{{body}}})"


class AxisRules:
    """Logical axis names -> mesh axes (flax/MaxText logical axis rules).

    ``rules`` is a sequence of ``(logical, mesh_axes)`` pairs (or a mapping); ``mesh_axes`` is a
    mesh axis name, a tuple of names, or None. A logical name may have several rules. Resolution
    is flax's ``logical_to_mesh_axes``: the rules are read in order, and a rule applies when its
    logical name is a dim of the tensor, that dim has no mesh axes yet and none of the rule's mesh
    axes is taken by another dim (a None rule always applies, leaving its dim replicated). A
    dim no rule applies to is replicated; ``strict=True`` makes a logical name with no rule at
    all an error.
    """

    def __init__(self, rules: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> None:
        out: list[tuple[str, Entry]] = []
        for logical, target in _pairs(rules, "axis rule", "(logical name, mesh axes)"):
            if not isinstance(logical, str) or not logical:
                _lfail(f"logical axis name {short(logical)} must be a non-empty str")
            out.append((logical, _entry(target, f"rule for {logical!r}")))
        self._rules = tuple(out)

    @property
    def rules(self) -> tuple[tuple[str, Entry], ...]:
        return self._rules

    def __repr__(self) -> str:
        return f"AxisRules({list(self._rules)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AxisRules) and self._rules == other._rules

    def __hash__(self) -> int:
        return hash(self._rules)

    def spec(
        self, logical_axes: Sequence[str | None], mesh: Mesh | None = None, *, strict: bool = False
    ) -> PartitionSpec:
        """The PartitionSpec for a tensor whose dims have these logical names (None: replicated).

        With ``mesh``, rules naming axes absent from it are an error.
        """
        if isinstance(logical_axes, str) or not isinstance(logical_axes, Sequence):
            _lfail(f"logical_axes must be a tuple of logical names, got {short(logical_axes)}")
        if mesh is not None and not isinstance(mesh, Mesh):
            _lfail(f"mesh must be a unimesh.Mesh, got {short(mesh)}")
        names: list[str | None] = []
        for name in logical_axes:
            if name is not None and not isinstance(name, str):
                _lfail(f"logical axis {short(name)} must be a str or None")
            names.append(name)
        position: dict[str, int] = {}  # logical name -> its dim
        for i, name in enumerate(names):
            if name is None:
                continue
            if name in position:
                _lfail(
                    f"logical axis {name!r} names more than one dim of {tuple(names)}; "
                    "give each dim its own logical name (flax refuses this too)"
                )
            position[name] = i
        if strict:
            known = {logical for logical, _ in self._rules}
            for name in position:
                if name not in known:
                    _lfail(f"no rule for logical axis {name!r}; rules cover {sorted(known)}")
        # flax's order: rule by rule, a rule applies when its logical name is a dim of the tensor,
        # that dim is still unassigned and none of its mesh axes is used yet.
        assigned: dict[int, Entry] = {}
        used: set[str] = set()
        for logical, target in self._rules:
            pos = position.get(logical)
            if pos is None:
                continue
            axes = _axes_of(target)
            if mesh is not None:
                for a in axes:
                    if a not in mesh.axis_names:
                        _lfail(
                            f"rule {logical!r} -> {target!r} names axis {a!r}, which is not "
                            f"in {mesh!r}"
                        )
            if pos in assigned or used.intersection(axes):
                continue
            assigned[pos] = target
            used.update(axes)
        return PartitionSpec(*(assigned.get(i) for i in range(len(names))))

    def layout(self, logical_axes: Sequence[str | None], mesh: Mesh) -> Layout:
        """``Layout(mesh, self.spec(logical_axes, mesh))``."""
        return Layout(mesh, self.spec(logical_axes, mesh))
