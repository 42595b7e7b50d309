"""How a worker forked from the zygote ends: what the interpreter's exit does that a script can
observe, without tearing down the modules it inherited.

A worker forked from ``hvd_edl/zygote.py`` shares the zygote's pages (torch, Horovod, numpy:
hundreds of MB of Python objects) copy-on-write.  CPython's finalisation clears every module and
drops every object, writing each one's reference count: every inherited page is copied, then
freed.  In a small test job (``tests/horovod_style/elastic_main.py``, 2 workers, 3 epochs; BSD
process accounting) that teardown was about 0.3 of a worker's 0.4 CPU-seconds.  So the worker
does what ``Py_FinalizeEx`` does first, in its order, and then ``os._exit``:

1. the exit status from the ``SystemExit`` as CPython computes it (``None``: 0, an int: itself,
   anything else printed to stderr: 1);
2. wait for the non-daemon threads (``threading._shutdown``, which also runs the functions
   ``threading._register_atexit`` holds: ``concurrent.futures``' pools);
3. the ``atexit`` functions (Horovod's shutdown, ``logging.shutdown``, ``weakref.finalize``'s
   exit hooks, the runtime's ``/exiting``);
4. the script's own objects dropped (``__main__``'s objects one at a time, latest first, its
   modules, classes and functions kept until a collection of the worker's own generations: the frozen, inherited objects are not visited), so their
   ``__del__`` and ``close`` run as at a normal exit: a file left open is flushed, a
   ``GzipFile`` or ``ZipFile`` written to the end, a ``NamedTemporaryFile`` removed;
5. ``sys.stdout`` / ``sys.stderr`` flushed (a failure: status 120, as CPython), and C's stdio
   buffers (``fflush(NULL)``, what ``exit()`` does);
6. ``os._exit(status)``.

What differs from an exec'd worker: objects of the script's that only another module still
refers to at exit are not dropped (their ``__del__`` does not run; CPython does not promise
that it runs either), and C++ static destructors are not run.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import os
import sys
import traceback
import types

FLUSH_FAILED_STATUS = 120  # CPython's exit status when the standard streams cannot be flushed


def exit_status(code) -> int:
    """The process exit status for ``SystemExit(code)``, as CPython computes it; a code that is
    neither None nor an int is printed to stderr (status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code if -(1 << 63) <= code < (1 << 63) else -1   # C long overflow: -1, as CPython
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001 - as CPython: the status stays 1
        pass
    return 1


def _drop_names(space: dict) -> None:
    """Drop a script's globals so that its objects' ``__del__`` still finds the rest, as CPython's
    teardown (a collection of ``__main__``'s cycle, every finaliser run before anything is
    cleared) does: first its objects, one at a time, latest first (one made later may use one
    made earlier), with its modules, classes, functions and ``__dunder__`` names still there;
    then a collection of their cycles; then every name (``dict.clear`` empties the dict before
    it drops a value: a ``__del__`` calling ``os.remove`` raised NameError)."""
    kept = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)
    value = None
    for name in reversed(list(space)):
        if isinstance(name, str) and name.startswith("__"):
            continue
        value = space.get(name)
        if not isinstance(value, kept):
            space.pop(name, None)
    del value
    gc.collect()
    space.clear()


def finish(code) -> None:
    """End this forked worker after its script raised ``SystemExit(code)`` (see the module);
    never returns."""
    status = exit_status(code)
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
    except BaseException:  # noqa: B902 - reported as CPython reports it, the exit goes on
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()   # prints each function's error, as at a normal exit
        for name in ("last_type", "last_value", "last_traceback"):   # the uncaught exception's
            if hasattr(sys, name):                                    # frames: dropped as CPython
                setattr(sys, name, None)                              # drops them, after atexit
        main = sys.modules.get("__main__")
        if main is not None:
            _drop_names(main.__dict__)
        gc.collect()
    except BaseException:  # noqa: B902
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not _closed(stream):   # as CPython's flush_std_files
                stream.flush()
        except Exception:  # noqa: BLE001 - as CPython: exit status 120
            status = FLUSH_FAILED_STATUS
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(status & 0xFF)   # as exit(): the low byte


def _closed(stream) -> bool:
    """CPython's ``file_is_closed``: a stream whose ``closed`` is true is not flushed (a script
    that closed ``sys.stdout`` ends with status 0); an unreadable ``closed``: not closed."""
    try:
        return bool(stream.closed)
    except Exception:  # noqa: BLE001 - as CPython: the error cleared, the stream flushed
        return False
