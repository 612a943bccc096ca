"""A neutral distribution config read from TOML or JSON: the mesh, layout rules for variables,
the batch axis and logical axis rules. One file, every framework (e.g. a Keras
``distribution``). Plain data only: nothing in a config file is evaluated or unpickled.

.. code-block:: toml

    mesh = "batch=2,model=4"          # or [mesh] axes = {batch = 2, model = 4}
    batch_axis = "batch"

    [layout]                          # variable-path regex -> spec, one entry per dim
    "dense.*/kernel" = "_,model"      # text: names, a+b, _ for replicated
    "dense.*/bias" = ["model"]        # or a list (JSON null / "_" for replicated)

    [axis_rules]                      # logical axis name -> mesh axis (or list, or "_")
    embed = "_"
    mlp = "model"

``axis_rules`` may instead be an ordered list of ``[logical, mesh_axes]`` pairs, where a logical
name may have several rules, tried in order (MaxText's fallbacks)::

    axis_rules = [["embed", ["fsdp", "model"]], ["embed", "fsdp"], ["mlp", "model"]]
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError, LayoutError, UnimeshError
from .layout import Layout
from .mesh import Mesh
from .messages import short
from .rules import AxisRules, LayoutMap, is_regex
from .spec import PartitionSpec

__all__ = ["Config", "load_config"]

KEYS = ("mesh", "layout", "batch_axis", "axis_rules")
#: Largest config text accepted (characters); a config is a few lines.
MAX_TEXT = 1_000_000


class Config:
    """A mesh plus how variables are laid out on it.

    Attributes:
        mesh: the :class:`~unimesh.Mesh`.
        layout_map: a :class:`~unimesh.LayoutMap` of the ``[layout]`` rules (empty if none).
        batch_axis: the mesh axis the batch is split over (default: the mesh's first axis).
        axis_rules: :class:`~unimesh.AxisRules` from ``[axis_rules]``, or None.
    """

    __slots__ = ("axis_rules", "batch_axis", "layout_map", "mesh")

    def __init__(
        self,
        mesh: Mesh,
        layout_map: LayoutMap | None = None,
        batch_axis: str | None = None,
        axis_rules: AxisRules | None = None,
    ) -> None:
        if not isinstance(mesh, Mesh):
            raise ConfigError(f"Config needs a unimesh.Mesh, got {short(mesh)}")
        from ._text import REPLICATED

        clash = next((a for a in mesh.axis_names if a in REPLICATED), None)
        if clash is not None:
            raise ConfigError(
                f"mesh axis {clash!r} cannot be written in a config, where 'None', 'none' and "
                "'_' mean replicated (it would read back as replicated); rename the axis"
            )
        if layout_map is not None and layout_map.mesh != mesh:
            raise ConfigError(f"the layout map is on {layout_map.mesh!r}, not on {mesh!r}")
        if batch_axis is not None and batch_axis not in mesh.axis_names:
            raise ConfigError(
                f"batch_axis {short(batch_axis)} is not an axis of {mesh!r}; "
                f"choose one of {list(mesh.axis_names)}"
            )
        self.mesh = mesh
        self.layout_map = layout_map if layout_map is not None else LayoutMap(mesh)
        self.batch_axis = batch_axis if batch_axis is not None else mesh.axis_names[0]
        self.axis_rules = axis_rules

    def __repr__(self) -> str:
        return (
            f"Config({self.mesh!r}, layout rules: {len(self.layout_map)}, "
            f"batch_axis={self.batch_axis!r}, axis_rules={self.axis_rules!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        return (self.mesh, self.layout_map, self.batch_axis, self.axis_rules) == (
            other.mesh,
            other.layout_map,
            other.batch_axis,
            other.axis_rules,
        )

    __hash__ = None  # type: ignore[assignment]

    # -- reading ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Config:
        """Build from parsed TOML/JSON (see the module docstring for the fields)."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a config is a table/object, got {short(d)} ({type(d).__name__})")
        unknown = [k for k in d if k not in KEYS]
        if unknown:
            raise ConfigError(
                f"unknown config key {short(unknown[0])}; valid keys are {list(KEYS)}"
            )
        if "mesh" not in d:
            raise ConfigError('a config needs a mesh, e.g. mesh = "dp=2,tp=4"')
        mesh = _in("mesh", lambda: _mesh(d["mesh"]))
        rules = d.get("layout", {})
        if not isinstance(rules, Mapping):
            raise ConfigError(f"[layout] must be a table of pattern = spec, got {short(rules)}")
        layout_map = LayoutMap(mesh)
        layouts: dict[Any, Layout] = {}  # one Layout per distinct spec (configs repeat them)
        for pattern, spec in rules.items():
            if not isinstance(pattern, str):
                raise ConfigError(f"[layout] keys are pattern strings, got {short(pattern)}")
            try:
                regex = is_regex(pattern)  # a key RE2 cannot take is a config error
            except LayoutError as exc:
                raise ConfigError(f"config [layout]: {exc}") from None
            memo = _memo_key(spec)
            layout = layouts.get(memo) if memo is not None else None
            if layout is None:
                layout = _in(
                    f"[layout] rule {short(pattern)}", lambda s=spec: Layout(mesh, _spec(s))
                )
                if memo is not None:
                    layouts[memo] = layout
            layout_map._set(pattern, layout, regex)
        batch = d.get("batch_axis")
        if batch is not None and not isinstance(batch, str):
            raise ConfigError(f"batch_axis must be an axis name (str), got {short(batch)}")
        axis_rules = None
        if "axis_rules" in d:
            pairs = [(k, _axes(v)) for k, v in _rule_pairs(d["axis_rules"])]
            axis_rules = _in("[axis_rules]", lambda: AxisRules(pairs))
            for logical, target in axis_rules.rules:
                named = (target,) if isinstance(target, str) else target or ()
                for axis in named:
                    if axis not in mesh.axis_names:
                        raise ConfigError(
                            f"[axis_rules] {logical!r} names axis {axis!r}, which "
                            f"is not in {mesh!r}"
                        )
        return cls(mesh, layout_map, batch, axis_rules)

    @classmethod
    def from_json(cls, text: str | bytes) -> Config:
        """Parse JSON text."""
        import json

        _check_text(text, "JSON")
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"not valid JSON: {short(text)} ({exc})") from None
        return cls.from_dict(d)

    @classmethod
    def from_toml(cls, text: str) -> Config:
        """Parse TOML text (``tomllib``; on Python 3.10 the ``tomli`` package)."""
        _check_text(text, "TOML")
        if not isinstance(text, str):
            raise ConfigError(f"TOML text must be str, got {type(text).__name__}")
        try:
            import tomllib as toml
        except ImportError:  # Python 3.10
            try:
                import tomli as toml  # type: ignore[no-redef,import-not-found,unused-ignore]
            except ImportError:
                raise ConfigError(
                    "reading TOML on Python 3.10 needs tomli: pip install tomli "
                    "(or write the config as JSON)"
                ) from None
        try:
            d = toml.loads(text)
        except (toml.TOMLDecodeError, RecursionError, ValueError) as exc:  # ValueError: an
            # integer of more than sys.get_int_max_str_digits() digits
            raise ConfigError(f"not valid TOML: {short(text)} ({exc})") from None
        return cls.from_dict(d)

    # -- writing ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that :meth:`from_dict` reads back to an equal config."""
        d: dict[str, Any] = {"mesh": self.mesh.to_string(), "batch_axis": self.batch_axis}
        if len(self.layout_map):
            d["layout"] = {
                k: [list(e) if isinstance(e, tuple) else e for e in v.spec.entries]
                for k, v in self.layout_map.items()
            }
        if self.axis_rules is not None:
            d["axis_rules"] = [
                [k, list(v) if isinstance(v, tuple) else v] for k, v in self.axis_rules.rules
            ]
            if len({k for k, _ in self.axis_rules.rules}) == len(self.axis_rules.rules):
                d["axis_rules"] = dict(d["axis_rules"])
        return d

    def to_json(self) -> str:
        """JSON text that :meth:`from_json` reads back to an equal config: indented, or compact
        where indenting would pass the size a config may have."""
        import json

        d = self.to_dict()
        text = json.dumps(d, indent=2)
        if len(text) > MAX_TEXT:
            text = json.dumps(d, separators=(",", ":"))
        if len(text) > MAX_TEXT:
            raise ConfigError(
                f"this config is {len(text)} characters as JSON, more than a config may be "
                f"({MAX_TEXT}); split its layout rules or use broader patterns"
            )
        return text


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> Config:
    """A :class:`Config` from a ``.toml`` or ``.json`` file (or an already parsed mapping)."""
    if isinstance(source, Mapping):
        return Config.from_dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"load_config() takes a file path or a dict, got {short(source)}")
    path = os.fspath(source)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {path!r} must end in .toml or .json")
    text = read_text_file(path, "config file", MAX_TEXT, ConfigError)
    return Config.from_toml(text) if suffix == ".toml" else Config.from_json(text)


def read_text_file(
    path: str, what: str, limit: int = MAX_TEXT, cls: type[Exception] = ConfigError
) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes. A FIFO, a device (a link to
    /dev/zero) or a directory is refused without reading it, so nothing blocks or reads
    forever."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise cls(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # before fdopen, which refuses a directory itself
        os.close(fd)
        raise cls(f"{what} {path!r} is not a regular file; give the path of a text file")
    with os.fdopen(fd, "rb") as fh:
        if info.st_size > limit:
            raise cls(f"{what} {path!r} is {info.st_size} bytes; it may be at most {limit}")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise cls(f"{what} {path!r} is more than {limit} bytes; it may be at most {limit}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise cls(f"{what} {path!r} is not UTF-8 text") from None


# -- helpers ---------------------------------------------------------------------------------
def _check_text(text: object, form: str) -> None:
    if not isinstance(text, (str, bytes, bytearray)):
        raise ConfigError(
            f"{form} config text must be str, got {short(text)} ({type(text).__name__})"
        )
    if len(text) > MAX_TEXT:
        raise ConfigError(
            f"{form} config text is {len(text)} characters; a config is at most {MAX_TEXT}"
        )


def _in(where: str, build: Any) -> Any:
    """Run ``build``; an error from the core gets the config location in front."""
    try:
        return build()
    except ConfigError:
        raise
    except UnimeshError as exc:
        raise type(exc)(f"config {where}: {exc}") from None


def _mesh(value: object) -> Mesh:
    if isinstance(value, str):
        return Mesh.from_string(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f'mesh must be a string like "dp=2,tp=4" or a table, got {short(value)}')
    d = dict(value)
    if "axes" in d:
        axes = d.pop("axes")
        if not isinstance(axes, Mapping) or not axes:
            raise ConfigError(f"mesh axes must be a table of name = size, got {short(axes)}")
        if "axis_names" in d or "shape" in d:
            raise ConfigError("give the mesh either axes = {...} or axis_names and shape, not both")
        d["axis_names"], d["shape"] = list(axes), list(axes.values())
    return Mesh.from_dict(d)


def _rule_pairs(raw: object) -> list[tuple[Any, Any]]:
    """``axis_rules`` as (logical, mesh axes) pairs: a table, or an ordered list of
    ``[logical, mesh_axes]`` pairs where a logical name may appear more than once."""
    if isinstance(raw, Mapping):
        return list(raw.items())
    if not isinstance(raw, list):
        raise ConfigError(
            "axis_rules must be a table of logical = mesh axes or a list of [logical, "
            f'mesh_axes] pairs (e.g. [["embed", "fsdp"], ["embed", "_"]]), got {short(raw)}'
        )
    pairs = []
    for i, pair in enumerate(raw):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ConfigError(
                f"axis_rules[{i}] is {short(pair)}; each rule is a pair [logical, mesh_axes], "
                'e.g. ["embed", "fsdp"] or ["mlp", ["tp", "ep"]]'
            )
        pairs.append((pair[0], pair[1]))
    return pairs


def _memo_key(spec: object) -> Any:
    """A hashable stand-in for a parsed spec value (str, or list of str/None/list of str), or
    None for anything else (parsed and checked on its own)."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, list) and all(
        e is None
        or isinstance(e, str)
        or (isinstance(e, list) and all(isinstance(a, str) for a in e))
        for e in spec
    ):
        return tuple(tuple(e) if isinstance(e, list) else e for e in spec), "list"
    return None


def _axes(value: object) -> Any:
    """One entry: a name, a list of names, or replicated (null, "_", "None", "")."""
    from ._text import REPLICATED

    if value is None or (isinstance(value, str) and value in REPLICATED):
        return None
    if isinstance(value, list):
        return tuple(value)
    return value


def _spec(value: object) -> PartitionSpec:
    if isinstance(value, str):
        return PartitionSpec.from_string(value)
    if isinstance(value, list):
        return PartitionSpec(*(_axes(v) for v in value))
    raise ConfigError(
        f'a spec is text like "_,model" or a list like [null, "model"], got '
        f"{short(value)} ({type(value).__name__})"
    )
