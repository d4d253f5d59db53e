"""A quiet start: TensorFlow's C++ start-up log kept off the console (without importing TF here).

TensorFlow prints lines from C++ as it loads and initialises ("oneDNN custom operations are on",
"Could not find cuda drivers", "failed call to cuInit", and absl's "All log messages before
absl::InitializeLog() ..."). `TF_CPP_MIN_LOG_LEVEL=3` hides those that TensorFlow's own logger
emits; those written through absl before logging is set up ignore it, so `import_tensorflow`
imports TensorFlow with file descriptor 2 sent to a temporary file and then passes on every line
of it that is not a C++ log line (Python warnings raised meanwhile still reach the console).

The binaries call `quiet_start(verbose)` first thing: unless the user set
`TF_CPP_MIN_LOG_LEVEL` or passed `--verbose`, it sets `TF_CPP_MIN_LOG_LEVEL=3` (inherited by the
actor processes and the fork server) and imports TensorFlow quietly. Our own warnings (Python
`logging`, the binaries' messages) are unaffected.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["import_tensorflow", "is_cpp_log_line", "quiet_start", "quiet_wanted", "silenced_stderr"]

_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
#: absl/TSL C++ log lines (`I0000 00:00:1795449521.722145    5367 port.cc:153] ...`), absl's
#: pre-initialisation notice and the continuation line of TensorFlow's CPU-feature notice.
_CPP_LINE = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:\d\d:[\d.]+\s+\d+ [\w./-]+:\d+\] "
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|To enable the following instructions: .* rebuild TensorFlow)"
)


def is_cpp_log_line(line: str) -> bool:
    """Whether `line` is one of TensorFlow's C++ log lines (see the module docstring)."""
    return bool(_CPP_LINE.match(line))


def quiet_wanted() -> bool:
    """True when TensorFlow's C++ log is to be hidden: `TF_CPP_MIN_LOG_LEVEL` is 3 or more."""
    try:
        return int(os.environ.get(_LEVEL, "0")) >= 3
    except ValueError:
        return False


@contextlib.contextmanager
def silenced_stderr() -> Iterator[None]:
    """Sends fd 2 to a temporary file; afterwards writes its non-C++-log lines to stderr."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # No stderr at all: nothing to silence.
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", "replace")
            kept = [line for line in text.splitlines(True) if not is_cpp_log_line(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def import_tensorflow() -> None:
    """Imports TensorFlow, without its C++ start-up lines when `quiet_wanted()`."""
    if "tensorflow" in sys.modules or not quiet_wanted():
        import tensorflow  # noqa: F401

        return
    with silenced_stderr():
        import tensorflow  # noqa: F401


def quiet_start(verbose: bool = False, import_now: bool = True) -> None:
    """Silences TensorFlow's C++ log unless `verbose` or the user set `TF_CPP_MIN_LOG_LEVEL`.

    Call it before anything imports TensorFlow.

    Args:
      verbose: Leave TensorFlow's log as it is.
      import_now: Import TensorFlow (quietly) now; else the caller does it later with
        `import_tensorflow()`.
    """
    if not verbose and _LEVEL not in os.environ:
        os.environ[_LEVEL] = "3"
    if import_now:
        import_tensorflow()
