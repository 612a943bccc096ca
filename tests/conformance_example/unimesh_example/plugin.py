from unimesh.plugin import hookimpl

from .backend import ThreadedExampleBackend


@hookimpl
def unimesh_backend() -> ThreadedExampleBackend:
    return ThreadedExampleBackend()
