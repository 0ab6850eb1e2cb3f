"""How a rank process ends once its trainer has returned: everything the interpreter's own exit does that another
process can see, then out, without the interpreter's teardown of the process's own memory.

A MaxText rank's interpreter teardown (every module's dict cleared, the objects of 4,000 modules collected, then
XLA's and the other extensions' destructors) took 1.07 s after the last atexit handler on the tiny model, quiet,
CPU only (the supervisor saw the exit 65 ms after the handlers with it skipped). Nothing in it is for anyone
else: the steps are committed by then, files written through `with` blocks, and the process's memory goes back to
the system either way. What others can see still happens, in the interpreter's own order (Py_FinalizeEx): the
threads that are not daemons are joined (threading's exit callbacks first: concurrent.futures' workers), then the
atexit handlers run (jax.distributed's shutdown barrier, which the other ranks wait in; logging's flush; absl's),
then the standard streams are flushed. Where this interpreter lacks one of those two hooks, the process exits the
ordinary way.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def status_of(code: object) -> int:
    """The exit status `sys.exit(code)` gives: None 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1


def exit_without_teardown(code: object) -> NoReturn:
    """End the process as `sys.exit(code)` would, less the interpreter's teardown of its own memory."""
    shutdown = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exit_handlers is None or threading.current_thread() is not threading.main_thread():
        raise SystemExit(code)
    status = status_of(code)
    shutdown()
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced: nothing of ours left in it
            pass
    os._exit(status)
