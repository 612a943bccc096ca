"""Parameter-rule policies: which layout each named array gets. :class:`LayoutMap` matches
names (Keras' ``LayoutMap``); :class:`AxisRules` resolves logical axis names (flax's
``logical_to_mesh_axes``); :class:`Resolver` reads either for a set of names, the one reading
``shard_params`` and ``load(target=LayoutMap | AxisRules)`` share, with the refusal of rule
keys that match no name."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from ._pyregex import RegexRefused, check_path, to_re2
from .layout import Layout
from .mesh import Mesh
from .messages import short
from .spec import Entry, PartitionSpec, entry_axes, layout_fail, parse_entry

__all__ = ["AxisRules", "LayoutMap", "Resolver"]


def _pairs(rules: object, what: str, form: str) -> list[tuple[Any, Any]]:
    """A mapping or a sequence of pairs as a list of pairs."""
    if isinstance(rules, Mapping):
        return list(rules.items())
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        layout_fail(f"{what}s must be a mapping or a list of {form} pairs, got {short(rules)}")
    out = []
    for pair in rules:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            layout_fail(f"{what} {short(pair)} is not a {form} pair")
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


def is_regex(key: str) -> str | None:
    """The RE2 form of ``key`` (None: a plain key, which only the exact lookup matches). A key
    is read in Python's regex syntax with Python's meaning (:mod:`unimesh._pyregex`) and
    handed to RE2, so a bad one is refused when the map is built. RE2 matches in time linear
    in the path whatever the pattern (Python's ``re`` backtracks exponentially on keys like
    ``(a+)+$``) and bounds nesting, repetition counts and program size."""
    _utf8(key, "LayoutMap key")
    if not _META.intersection(key):
        return None
    try:
        pattern = to_re2(key)
    except RegexRefused as exc:
        layout_fail(
            f"LayoutMap key {short(key)} is not a regex unimesh can match: {exc.args[0]}. "
            "Keys are Python regexes without lookaround, backreferences, (?i) or Unicode \\b"
        )
    re2, options = _re2()
    try:
        re2.Set.FullMatchSet(options).Add(pattern)  # parses only: cheap
    except re2.error:
        try:  # the set says only that it failed; a compile says why
            re2.compile(pattern, options)
            reason = "too large"
        except re2.error as exc:
            reason = exc.args[0] if exc.args else str(exc)
            if isinstance(reason, bytes):
                reason = reason.decode("utf-8", "replace")
        layout_fail(
            f"LayoutMap key {short(key)} is not a regex unimesh can match ({reason[:120]}); "
            "keys are Python regexes without lookaround, backreferences, (?i) or Unicode "
            "\\b, with repetition counts up to 1000"
        )
    return pattern


class _KeySet:
    """Up to ``_CHUNK`` keys in one RE2 full-match set, which tests them all in one pass.

    RE2 runs a set on its DFA only, and a DFA that runs out of memory (large Unicode classes
    on unusual paths) makes the set answer "no match" without saying it failed. So the set
    holds one more pattern that matches every path: an answer without it is a failure, and
    then the keys are tried one by one (RE2's regexes fall back to their NFA, still linear)."""

    __slots__ = ("keys", "one_by_one", "set")

    def __init__(self, group: Any, keys: list[str]) -> None:
        self.set = group
        self.keys = keys
        self.one_by_one: list[Any] | None = None

    def match(self, path: str) -> list[int]:
        found = self.set.Match(path) or ()
        if len(self.keys) in found:  # the always-matching sentinel: the DFA answered
            return sorted(i for i in found if i < len(self.keys))
        if self.one_by_one is None:
            re2, options = _re2()
            self.one_by_one = [re2.compile(key, options) for key in self.keys]
        return [i for i, regex in enumerate(self.one_by_one) if regex.fullmatch(path)]


def _matchers(keys: list[str]) -> list[tuple[int, Any]]:
    """(offset, matcher) over ``keys`` (RE2 patterns) in order: :class:`_KeySet` s of up to
    ``_CHUNK`` keys, or one compiled key where a set is too big to compile."""
    re2, options = _re2()
    out: list[tuple[int, Any]] = []
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start : start + _CHUNK]
        group = re2.Set.FullMatchSet(options)
        for key in chunk:
            group.Add(key)
        group.Add("(?s:.*)")
        try:
            group.Compile()
            out.append((start, _KeySet(group, chunk)))
        except re2.error:
            out.extend((start + i, re2.compile(key, options)) for i, key in enumerate(chunk))
    return out


def _utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        layout_fail(
            f"{what} {short(text)} is not valid Unicode text (character {exc.start} is a lone "
            "surrogate); use a str that encodes as UTF-8"
        )


class LayoutMap(MutableMapping[str, Layout]):
    """Ordered mapping of variable-path patterns to layouts (``keras.distribution.LayoutMap``).

    Lookup follows Keras 3: an exact key wins; else every key is tried as a regex that must
    match the whole path (``re.fullmatch``); two matching keys are an error naming both; none
    gives None. Keys are Python regexes with Python's meaning (``\\w`` and ``\\d`` are
    Unicode, ``\\Z`` ends the path), matched by RE2 so that a lookup takes time linear in the
    path whatever the keys; what RE2 cannot mean the same way (lookaround, backreferences,
    ``(?i)``, a Unicode ``\\b``) is refused when the key is set. As in Keras, a key is set once:
    setting it again is an error (``del`` it first). Values may be PartitionSpecs or tuples
    of entries and are validated against ``mesh``. A full mutable mapping: ``keys``,
    ``items``, ``pop``, ``update``, ``clear`` and the rest work on the keys as written.
    """

    def __init__(
        self, mesh: Mesh, rules: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()
    ) -> None:
        if not isinstance(mesh, Mesh):
            layout_fail(f"LayoutMap() needs a unimesh.Mesh, got {short(mesh)}")
        self._mesh = mesh
        self._rules: dict[str, Layout] = {}
        self._regexes: dict[str, str] = {}  # regex keys, in order -> their RE2 form
        self._matching: list[tuple[int, Any]] | None = None  # built by the first lookup
        for key, value in _pairs(rules, "LayoutMap rule", "(pattern, spec)"):
            self[key] = value

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            layout_fail(f"LayoutMap keys are regex strings, got {short(key)}")
        self._set(key, value, is_regex(key))

    def _set(self, key: str, value: Any, regex: str | None) -> None:
        """``self[key] = value`` for a key already checked (``regex``: :func:`is_regex`)."""
        if key in self._rules:
            layout_fail(
                f"LayoutMap key {short(key)} is already set (to {self._rules[key].spec!r}); "
                "Keras refuses a key twice too: del layout_map[key] first to replace it"
            )
        if isinstance(value, Layout):
            if value.mesh is not self._mesh and value.mesh != self._mesh:
                layout_fail(
                    f"layout for {key!r} is on {value.mesh!r}, not this map's {self._mesh!r}"
                )
            layout = value
        else:
            layout = Layout(self._mesh, value)
        self._rules[key] = layout
        if regex is not None:
            self._regexes[key] = regex
            self._matching = None

    def __delitem__(self, key: str) -> None:
        del self._rules[key]
        if self._regexes.pop(key, None) is not None:
            self._matching = None

    def __getitem__(self, path: str) -> Layout | None:  # type: ignore[override]
        return self.get(path)

    def get(self, path: str, default: Layout | None = None) -> Layout | None:  # type: ignore[override]
        """The layout for a variable path, or ``default`` (None) when no key matches."""
        key = self.key_for(path)
        return default if key is None else self._rules[key]

    def key_for(self, path: str) -> str | None:
        """The key (as written) whose rule gives ``path`` its layout, or None."""
        if not isinstance(path, str):
            layout_fail(f"LayoutMap lookups take a str path, got {short(path)}")
        if path in self._rules:
            return path
        _utf8(path, "LayoutMap path")
        if not self._regexes:
            return None
        why = check_path(path)
        if why is not None:
            layout_fail(f"LayoutMap path {short(path)} cannot be matched: {why}")
        keys = list(self._regexes)
        if self._matching is None:
            self._matching = _matchers([self._regexes[k] for k in keys])
        hits = []
        for offset, matcher in self._matching:
            if hasattr(matcher, "fullmatch"):
                if matcher.fullmatch(path):
                    hits.append(keys[offset])
            else:
                hits.extend(keys[offset + i] for i in matcher.match(path))
        if len(hits) > 1:
            layout_fail(
                f"path {path!r} matches more than one LayoutMap key: {hits[0]!r} and "
                f"{hits[1]!r}; make the patterns exclusive"
            )
        return hits[0] if hits else None

    def with_fsdp(self, axis: str, dim: int = 0, params: Iterable[str] = ()) -> LayoutMap:
        """This map with every rule's dim ``dim`` split over ``axis`` too, as FSDP does over a
        tensor-parallel layout: ``axis`` becomes the minor-most axis of that dim (each TP
        block is split again, torch's ``_StridedShard``), so ``P('tp', None)`` becomes
        ``P(('tp', 'dp'), None)`` and ``P(None, 'tp')`` becomes ``P('dp', 'tp')``. Each path
        in ``params`` that no rule matches (say ``[n for n, _ in model.named_parameters()]``)
        gets a rule of its own splitting dim ``dim`` over ``axis``."""
        if not isinstance(axis, str) or axis not in self._mesh.axis_names:
            layout_fail(f"with_fsdp() axis {short(axis)} is not an axis of {self._mesh!r}")
        if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < 64:
            layout_fail(f"with_fsdp() dim must be an int in [0, 64), got {short(dim)}")
        if isinstance(params, (str, bytes)):
            layout_fail(
                f"with_fsdp() params is an iterable of parameter paths, got {short(params)}"
            )
        out = LayoutMap(self._mesh)
        for key, layout in self._rules.items():
            entries = [*layout.spec, *([None] * (dim + 1 - len(layout.spec)))]
            if axis in layout.spec.axes():
                layout_fail(
                    f"rule {key!r} already uses axis {axis!r} ({layout.spec!r}); with_fsdp() "
                    f"adds it to dim {dim}: leave it out of the rule or pick another axis"
                )
            held = entries[dim]
            names = () if held is None else (held,) if isinstance(held, str) else tuple(held)
            entries[dim] = (*names, axis) if names else axis
            out._set(key, PartitionSpec(*entries), self._regexes.get(key))
        for path in params:
            if not isinstance(path, str):
                layout_fail(f"with_fsdp() params are parameter paths (str), got {short(path)}")
            key = re.escape(path)
            if self.key_for(path) is None and key not in out:
                out._set(key, PartitionSpec(*([None] * dim), axis), is_regex(key))
        return out

    def pop(self, key: str, *default: Any) -> Any:
        """Remove the key as written (not matched as a regex) and return its layout."""
        if key in self._rules:
            layout = self._rules[key]
            del self[key]
            return layout
        if default:
            return default[0]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key in self._rules

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def items(self) -> list[tuple[str, Layout]]:  # type: ignore[override]
        return list(self._rules.items())

    def values(self) -> list[Layout]:  # type: ignore[override]
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
                layout_fail(f"logical axis name {short(logical)} must be a non-empty str")
            out.append((logical, parse_entry(target, f"rule for {logical!r}")))
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
            layout_fail(f"logical_axes must be a tuple of logical names, got {short(logical_axes)}")
        if mesh is not None and not isinstance(mesh, Mesh):
            layout_fail(f"mesh must be a unimesh.Mesh, got {short(mesh)}")
        names: list[str | None] = []
        for name in logical_axes:
            if name is not None and not isinstance(name, str):
                layout_fail(f"logical axis {short(name)} must be a str or None")
            names.append(name)
        position: dict[str, int] = {}  # logical name -> its dim
        for i, name in enumerate(names):
            if name is None:
                continue
            if name in position:
                layout_fail(
                    f"logical axis {name!r} names more than one dim of {tuple(names)}; "
                    "give each dim its own logical name (flax refuses this too)"
                )
            position[name] = i
        if strict:
            known = {logical for logical, _ in self._rules}
            for name in position:
                if name not in known:
                    layout_fail(f"no rule for logical axis {name!r}; rules cover {sorted(known)}")
        # flax's order: rule by rule, a rule applies when its logical name is a dim of the tensor,
        # that dim is still unassigned and none of its mesh axes is used yet.
        assigned: dict[int, Entry] = {}
        used: set[str] = set()
        for logical, target in self._rules:
            pos = position.get(logical)
            if pos is None:
                continue
            axes = entry_axes(target)
            if mesh is not None:
                for a in axes:
                    if a not in mesh.axis_names:
                        layout_fail(
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


class Resolver:
    """Names to layouts by ``rules``: a :class:`LayoutMap`, or :class:`AxisRules` with
    ``logical_axes`` (a dict or a function from name to logical axis names) and ``mesh``.
    ``call`` names the caller in errors (``shard_params()``, ``load()``)."""

    def __init__(self, rules: Any, mesh: Any, logical_axes: Any, call: str) -> None:
        if isinstance(rules, LayoutMap):
            if mesh is not None and mesh != rules.mesh:
                layout_fail(f"the layout map is on {rules.mesh!r}, not on mesh={mesh!r}")
            mesh = rules.mesh
        elif isinstance(rules, AxisRules):
            if not isinstance(mesh, Mesh):
                layout_fail(
                    f"{call} with AxisRules needs mesh=unimesh.Mesh(...), got {short(mesh)}"
                )
            if not callable(logical_axes) and not isinstance(logical_axes, dict):
                layout_fail(
                    f"{call} with AxisRules needs logical_axes: a dict {{path: (logical axis "
                    f"names)}} or a function of the path, got {short(logical_axes)}"
                )
        else:
            layout_fail(
                f"{call} takes a unimesh.LayoutMap or unimesh.AxisRules, got {short(rules)}"
            )
        self.rules, self.mesh, self.logical_axes = rules, mesh, logical_axes

    def layout(self, name: str) -> Layout | None:
        """The layout the rules give ``name``; None where no rule matches it (replicated)."""
        if isinstance(self.rules, LayoutMap):
            return self.rules.get(name)
        axes = self.logical_axes
        names = axes(name) if callable(axes) else axes.get(name)
        return None if names is None else Layout(self.mesh, self.rules.spec(names, self.mesh))

    def unmatched(
        self, names: list[str], strict: bool, what: str, whose: str, stacklevel: int = 3
    ) -> None:
        """Refuse (or, not ``strict``, warn of) rule keys that match none of ``names``;
        ``what`` is what a name is (``parameter of the model``), ``whose`` what the names
        are (``The model's parameter paths``); a warning points ``stacklevel`` frames up."""
        import difflib

        rules, logical_axes = self.rules, self.logical_axes
        if isinstance(rules, LayoutMap):
            used = {rules.key_for(p) for p in names}
            keys, kind = [k for k in rules if k not in used], "LayoutMap keys"
        elif isinstance(logical_axes, dict):
            known = set(names)
            keys, kind = [k for k in logical_axes if k not in known], "logical_axes paths"
        else:
            return
        if not keys:
            return
        plain = {k: k.replace("\\", "") for k in keys}  # 'attn\\.wq' reads as 'attn.wq'

        def words(text: str) -> list[str]:
            return text.replace("/", ".").split(".")

        near = []
        candidates = names[:5000]  # an error's hint: bounded work on a model of any size
        for key in keys[:3]:
            want = words(plain[key])
            score = {  # against the name's last as many parts, in either spelling
                p: difflib.SequenceMatcher(
                    None, ".".join(want), ".".join(words(p)[-len(want) :])
                ).ratio()
                + difflib.SequenceMatcher(None, plain[key], p).ratio() / 10
                for p in candidates
            }
            close = [p for p in sorted(candidates, key=lambda p: -score[p])[:2] if score[p] >= 0.3]
            near.append(f"{short(key, 80)} (closest: {', '.join(map(repr, close)) or 'none'})")
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        total = len(rules) if isinstance(rules, LayoutMap) else len(logical_axes)
        text = (
            f"{len(keys)} of {total} {kind} match no {what}: {'; '.join(near)}{more}. "
            f"{whose} look like "
            f"{short(names[:4], 160)} ({len(names)} in all)"
        )
        if any("." in plain[k] for k in keys) and any("/" in p for p in names):
            text += (
                "; these are torch names on a '/'-joined tree: make the map with "
                "unimesh_torch.layout_map_from_plan(..., names='flax') or names='keras'"
            )
        text += "; fix the keys, or pass strict=False to only warn"
        if strict:
            layout_fail(text)
        import warnings

        warnings.warn(text, UserWarning, stacklevel=stacklevel)
