"""unimesh: describe a device mesh and tensor layouts once, get every framework's native objects.

``import unimesh`` imports numpy and the standard library only; no ML framework is imported until
a backend needs it.
"""

from __future__ import annotations

from .backend import CAPABILITIES, CONCEPTS, FEATURES, LAYERS, Backend
from .checkpoint import Checkpoint, SaveHandle, async_save, load, open_checkpoint, save
from .collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pbroadcast,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
)
from .config import Config, load_config
from .convert import distribute, from_local, from_native, layout_of, local_shards, to_native
from .errors import (
    AxisContextError,
    BackendNotFoundError,
    BackendRegistrationError,
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    ConversionError,
    LaunchError,
    LayoutError,
    LinkError,
    MeshMismatchError,
    MeshSpecError,
    UnimeshError,
    UnsupportedError,
)
from .fusion import Concat, Slice
from .layout import Layout
from .link import Link, link
from .mesh import Mesh, current_mesh
from .mesh_utils import make_mesh
from .parallel import compile, full_array, grad, shard_map, stop_gradient, value_and_grad
from .params import shard_params
from .placements import Partial, Placement, Replicate, Shard, StridedShard
from .registry import backends, get_backend, refresh_backends, register_backend, unregister_backend
from .reshard import reshard
from .rules import AxisRules, LayoutMap
from .runtime import Launcher, detect_launcher, initialize, verify
from .spec import P, PartitionSpec
from .visual import visualize

__version__ = "0.1.0"

__all__ = [
    "CAPABILITIES",
    "CONCEPTS",
    "FEATURES",
    "LAYERS",
    "AxisContextError",
    "AxisRules",
    "Backend",
    "BackendNotFoundError",
    "BackendRegistrationError",
    "BackendUnavailableError",
    "Checkpoint",
    "CheckpointError",
    "Concat",
    "Config",
    "ConfigError",
    "ConversionError",
    "LaunchError",
    "Launcher",
    "Layout",
    "LayoutError",
    "LayoutMap",
    "Link",
    "LinkError",
    "Mesh",
    "MeshMismatchError",
    "MeshSpecError",
    "P",
    "Partial",
    "PartitionSpec",
    "Placement",
    "Replicate",
    "SaveHandle",
    "Shard",
    "Slice",
    "StridedShard",
    "UnimeshError",
    "UnsupportedError",
    "all_gather",
    "all_to_all",
    "async_save",
    "axis_index",
    "axis_size",
    "backends",
    "compile",
    "current_mesh",
    "detect_launcher",
    "distribute",
    "from_local",
    "from_native",
    "full_array",
    "get_backend",
    "grad",
    "initialize",
    "layout_of",
    "link",
    "load",
    "load_config",
    "local_shards",
    "make_mesh",
    "open_checkpoint",
    "pbroadcast",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "refresh_backends",
    "register_backend",
    "reshard",
    "save",
    "shard_map",
    "shard_params",
    "stop_gradient",
    "to_native",
    "unregister_backend",
    "value_and_grad",
    "verify",
    "visualize",
]
