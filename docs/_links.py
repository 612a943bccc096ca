"""Where the frameworks document the names these docs link to.

The docs build offline (CI reaches package registries only), so the projects' own
``objects.inv`` files cannot be fetched at build time. For the projects whose docs are built
with Sphinx, :func:`write_inventories` writes an inventory from :data:`SPHINX` that
intersphinx reads as a local file; Keras and TensorFlow (not Sphinx sites) are plain links
(:data:`PLAIN`). :func:`linked` turns a name in a table cell into its link.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

#: project -> (documentation root, {object name: (py role, address under the root)})
SPHINX: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "torch": (
        "https://docs.pytorch.org/docs/stable/",
        {
            "torch.distributed.device_mesh.DeviceMesh": ("class", "distributed.html"),
            "torch.distributed.device_mesh.init_device_mesh": ("function", "distributed.html"),
            "torch.distributed.tensor.DTensor": ("class", "distributed.tensor.html"),
            "torch.distributed.tensor.distribute_tensor": ("function", "distributed.tensor.html"),
            "torch.distributed.tensor.Shard": ("class", "distributed.tensor.html"),
            "torch.distributed.tensor.Replicate": ("class", "distributed.tensor.html"),
            "torch.distributed.tensor.Partial": ("class", "distributed.tensor.html"),
            "torch.distributed.tensor.parallel.parallelize_module": (
                "function",
                "distributed.tensor.parallel.html",
            ),
            "torch.distributed.init_process_group": ("function", "distributed.html"),
        },
    ),
    "jax": (
        "https://docs.jax.dev/en/latest/",
        {
            "jax.sharding.Mesh": ("class", "jax.sharding.html"),
            "jax.sharding.AbstractMesh": ("class", "jax.sharding.html"),
            "jax.sharding.NamedSharding": ("class", "jax.sharding.html"),
            "jax.sharding.PartitionSpec": ("class", "jax.sharding.html"),
            **{
                name: ("function", f"_autosummary/{name}.html")
                for name in (
                    "jax.shard_map",
                    "jax.make_mesh",
                    "jax.grad",
                    "jax.value_and_grad",
                    "jax.make_array_from_callback",
                    "jax.distributed.initialize",
                    "jax.lax.psum",
                    "jax.lax.psum_scatter",
                    "jax.lax.all_gather",
                    "jax.lax.all_to_all",
                    "jax.lax.ppermute",
                    "jax.lax.axis_index",
                )
            },
        },
    ),
    "mlx": (
        "https://ml-explore.github.io/mlx/build/html/",
        {
            name: (role, f"python/_autosummary/{name}.html")
            for name, role in (
                ("mlx.core.distributed.init", "function"),
                ("mlx.core.distributed.Group", "class"),
                ("mlx.core.distributed.all_sum", "function"),
                ("mlx.core.distributed.all_gather", "function"),
                ("mlx.core.distributed.send", "function"),
                ("mlx.core.distributed.recv", "function"),
            )
        },
    ),
    "numpy": (
        "https://numpy.org/doc/stable/",
        {"numpy.ndarray": ("class", "reference/generated/numpy.ndarray.html")},
    ),
}

#: object name -> page, for sites not built with Sphinx
PLAIN: dict[str, str] = {
    **{
        f"keras.distribution.{name}": "https://keras.io/api/distribution/layout_map/"
        for name in ("DeviceMesh", "TensorLayout", "LayoutMap", "distribute_tensor")
    },
    "keras.distribution.ModelParallel": "https://keras.io/api/distribution/model_parallel/",
    **{
        f"tf.experimental.dtensor.{name}": (
            f"https://www.tensorflow.org/api_docs/python/tf/experimental/dtensor/{name}"
        )
        for name in ("Mesh", "Layout", "copy_to_mesh", "relayout")
    },
}


def inventory(project: str) -> bytes:
    """``project``'s entries of :data:`SPHINX` in Sphinx's inventory format (version 2)."""
    _, names = SPHINX[project]
    lines = "".join(
        f"{name} py:{role} 1 {page}#$ -\n" for name, (role, page) in sorted(names.items())
    )
    head = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n# Version: \n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    return head.encode() + zlib.compress(lines.encode())


def write_inventories(out: Path) -> dict[str, tuple[str, str]]:
    """Write ``out/<project>.inv`` for every project; return ``intersphinx_mapping``."""
    mapping = {}
    for project, (root, _) in SPHINX.items():
        path = out / f"{project}.inv"
        data = inventory(project)
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
        mapping[project] = (root, str(path))
    return mapping


#: the short module names the tables use
ALIASES = {"mx": "mlx.core", "np": "numpy"}

_NAME = re.compile(r"[A-Za-z_][\w.]*\.[\w]+")


def linked(text: str) -> str:
    """``text`` (a Markdown table cell) with the first known object name made a link: a
    ``{py:obj}`` reference for Sphinx projects (intersphinx resolves it), a plain link for
    the others."""
    known = {n for _, names in SPHINX.values() for n in names}
    for match in _NAME.finditer(text):
        name = match.group(0)
        full = ALIASES.get(name.split(".")[0], name.split(".")[0]) + name[name.find(".") :]
        if full in known:
            ref = f"{{py:obj}}`{name} <{full}>`" if full != name else f"{{py:obj}}`{name}`"
        elif name in PLAIN:
            ref = f"[`{name}`]({PLAIN[name]})"
        else:
            continue
        return text[: match.start()] + ref + text[match.end() :]
    return text
