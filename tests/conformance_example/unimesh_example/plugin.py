from unimesh.plugin import hookimpl

from .backend import ExampleBackend


@hookimpl
def unimesh_backend() -> ExampleBackend:
    return ExampleBackend()
