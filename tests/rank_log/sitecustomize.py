"""Put on PYTHONPATH by tests/support/launch.py: a launched rank's stdout and stderr go to a file
of its own, ``$UNIMESH_TEST_RANK_LOG/rank-N.log``, so that ranks sharing the launcher's pipe cannot
interleave inside a line (torchrun runs ranks with ``python -u``, where ``print`` writes the text
and its newline in two calls). The rank is the launcher's own variable: ``RANK`` (torchrun),
``OMPI_COMM_WORLD_RANK`` (mpirun), ``MLX_RANK`` (mlx.launch). A process without one (the
launcher itself, a plain subprocess) is left alone."""

import os

_DIR = os.environ.get("UNIMESH_TEST_RANK_LOG")
if _DIR:
    for _name in ("RANK", "OMPI_COMM_WORLD_RANK", "MLX_RANK"):
        if os.environ.get(_name, "").isdigit():
            _fd = os.open(
                os.path.join(_DIR, f"rank-{int(os.environ[_name])}.log"),
                os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                0o644,
            )
            os.dup2(_fd, 1)
            os.dup2(_fd, 2)
            os.close(_fd)
            break
