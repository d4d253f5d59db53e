"""What every binary shares (impala-train, impala-evaluate, impala-export): flags defined once,
the current directory on the import path, and the entry point that makes `--help` whole.

absl refuses a flag defined by two modules, and a process (a test, a notebook) may import
several binaries.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable

from absl import app, flags

__all__ = ["FLAGS", "import_from_cwd", "run_binary"]


def import_from_cwd() -> None:
    """Makes the current directory importable, as `python -m` would: a config's import paths
    (custom models, callbacks, env creators, policy mapping functions) may name the user's
    own modules. Call it before the run's plan resolves them (worker processes started later
    inherit the path)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


FLAGS = flags.FLAGS

flags.DEFINE_bool(
    "verbose",
    False,
    "Show TensorFlow's C++ start-up log; impala-train also prints the full result dict "
    "each iteration.",
)


def run_binary(main: Callable[[list[str]], int], module_name: str, doc: str | None) -> None:
    """Runs a binary's `main` under absl, with a `--help` that lists its flags and docstring.

    absl's `--help` prints the docstring of `__main__` and the flags that module defined. Under
    a console script (`impala-train`) `__main__` is pip's wrapper, which has neither: the help
    came out as one usage line. Here the binary's module lends both to whatever `__main__` is,
    so `impala-train --help` and `python -m impala_tf.bin.train --help` print the same.

    When `main` returns, the process exits at once with its code: the non-daemon threads are
    waited for, the atexit handlers run (logging, Ray, multiprocessing), the output is flushed,
    the fork server and resource tracker are ended, and the interpreter's teardown is skipped.
    With TensorFlow loaded that teardown (freeing every graph, kernel and dataset object, one
    by one) took 1.5-4 s after the run had ended, every child stopped and the last checkpoint
    written, all of which `main` finishes before it returns. A `main` that raises exits the
    ordinary way, through absl's error handling.

    Args:
      main: the binary's main(argv) -> exit code.
      module_name: the module that defines the binary's flags (its `__name__`).
      doc: the text `--help` opens with (the module's docstring).
    """
    main_module = sys.modules["__main__"]
    if doc and not getattr(main_module, "__doc__", None):
        main_module.__doc__ = doc
    # absl keys the flags of `__main__` by sys.argv[0]; its key flags are what --help lists.
    for name in (module_name, __name__):
        for flag in FLAGS.get_key_flags_for_module(name):
            FLAGS.register_key_flag_for_module(sys.argv[0], flag)

    def main_then_exit(argv: list[str]) -> None:
        code = main(argv)
        _exit_without_teardown(code)

    app.run(main_then_exit)


def _exit_without_teardown(code: int | None) -> None:
    """Does what the interpreter's exit does before its teardown (waits for the non-daemon
    threads, a user callback's upload say, then runs the atexit handlers), flushes stdout and
    stderr, and ends the process with `code`."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # What sys.exit would run; the teardown after it is what we skip.
    if "multiprocessing" in sys.modules:  # Not to leave the fork server running as we go.
        from impala_tf.workers.process import stop_helper_processes

        stop_helper_processes()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)
