"""Every example program named on the command line, one after another in this process (one
launch for all of them): ``python tests/workers/examples_worker.py NAME[,NAME...] -- EXAMPLE ARGS``.

Each example's ``main()`` runs with ``sys.argv`` set to its own command line; what it prints is
captured and printed again with ``[NAME] `` before each line, then ``[NAME] EXIT code`` (its
return value, or the code it exited with). ``[NAME] START`` goes out first, unbuffered, so a
launch that hangs names the example it hung in. Started by tests/test_examples.py.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
import traceback
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def main() -> int:
    names, args = sys.argv[1].split(","), sys.argv[sys.argv.index("--") + 1 :]
    sys.path.insert(0, str(EXAMPLES))
    for name in names:
        print(f"[{name}] START", flush=True)
        buffer = io.StringIO()
        sys.argv = [str(EXAMPLES / f"{name}.py"), *args]
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                code = importlib.import_module(name).main()
            except SystemExit as exc:  # argparse's error, or an example's own exit
                code = exc.code if isinstance(exc.code, int) else 1
                print(exc.code if not isinstance(exc.code, int) else "", flush=True)
            except Exception:  # noqa: BLE001 - reported as this example's failure
                traceback.print_exc()
                code = 1
        for line in buffer.getvalue().splitlines():
            print(f"[{name}] {line}", flush=True)
        print(f"[{name}] EXIT {code}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
