"""The unimesh conformance suite: one set of tests, written against the core's reference
semantics, run through any installed backend.

    pytest --pyargs unimesh.conformance --unimesh-backend jax [--unimesh-backend keras ...]
    UNIMESH_CONFORMANCE_BACKENDS=jax,keras pytest --pyargs unimesh.conformance
    torchrun --standalone --nproc-per-node 4 -m pytest --pyargs unimesh.conformance \\
        --unimesh-backend torch                # multi-process mode: the suite runs in every rank

Each test names the capability it exercises; a test for a capability the backend does not
declare is skipped with that name. Requests a backend does not declare must raise
``unimesh.UnsupportedError``. At the end a capability matrix (backend x capability: pass / fail /
not declared) is printed, and written with ``--unimesh-matrix-json PATH`` /
``--unimesh-matrix-md PATH``. The pytest plugin (``unimesh.conformance.pytest_plugin``) is
registered through the ``pytest11`` entry point and stays inert unless the suite is asked for.
"""

#: The capabilities the suite exercises, in matrix order.
CHECKED = (
    "mesh",
    "layout",
    "tuple_axes",
    "partial",
    "distribute",
    "from_local",
    "uneven_shards",
    "layout_map",
    "axis_groups",
    "shard_map",
    "grad",
    "shard_params",
    "checkpoint",
    "reshard",
    "multi_process",
)
