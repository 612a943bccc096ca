"""One process of ``unimesh demo`` on a backend that runs one process per device, started by
the backend's own launcher: ``<launcher> -m unimesh.cli.demo_worker BACKEND MESH``.

Starts the backend's distributed runtime, runs :func:`unimesh.cli.demo.trial` (printing
``UNIMESH_STEP RANK STEP`` as each step begins) and prints ``UNIMESH_DEMO {json}`` with what
this process saw; the demo merges every process's line.
"""

from __future__ import annotations

import json
import sys

#: Seconds the processes have to find each other, and to meet at the end.
TIMEOUT = 60.0


def main(argv: list[str] | None = None) -> int:
    import unimesh

    from .demo import trial

    name, spec = (argv if argv is not None else sys.argv[1:])[:2]
    backend = unimesh.get_backend(name)
    index, _ = backend.initialize(TIMEOUT)

    def step(what: str) -> None:  # the demo's progress display reads these as they come
        sys.stdout.write(f"UNIMESH_STEP {index} {what}\n")
        sys.stdout.flush()

    report = {"process": index, **trial(backend, unimesh.Mesh.from_string(spec), step)}
    sys.stdout.write("UNIMESH_DEMO " + json.dumps(report) + "\n")
    sys.stdout.flush()
    backend.exchange(b"done", TIMEOUT)  # nobody leaves while a peer still needs it
    return 0


if __name__ == "__main__":
    sys.exit(main())
