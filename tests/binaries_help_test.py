"""`--help` of each binary, as a console script and as `python -m`: the binary's docstring and
every flag it defines, each with its help text (absl lists only the flags of `__main__`, which
under a console script is pip's wrapper)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARIES = {
    "impala-train": "impala_tf.bin.train",
    "impala-evaluate": "impala_tf.bin.evaluate",
    "impala-export": "impala_tf.bin.export",
}


def _help(command: list[str]) -> str:
    done = subprocess.run(
        [*command, "--help"],
        cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    # absl's --help exits 1 (its convention for usage); anything else is a crash.
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return done.stdout + done.stderr


_DEFINED = """
import json, sys, importlib
from absl import flags
module = importlib.import_module(sys.argv[1])
defined = [*flags.FLAGS.get_key_flags_for_module(module.__name__), flags.FLAGS["verbose"]]
print(json.dumps({"doc": module.__doc__, "flags": {f.name: f.help for f in defined}}))
"""


def _defined(module: str) -> dict:
    """The binary's docstring and flags, read in a process of its own (the three binaries
    define some flags of the same name, which absl refuses in one process)."""
    done = subprocess.run(
        [sys.executable, "-c", _DEFINED, module],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", sorted(BINARIES))
def test_help_lists_every_flag_with_its_help_and_the_docstring(script):
    console = os.path.join(os.path.dirname(sys.executable), script)
    # The README's test command installs the package, console scripts included.
    assert os.path.exists(console), f"{script} is not installed beside this Python"
    defined = _defined(BINARIES[script])
    assert len(defined["flags"]) >= 4, "the binary's own flags and --verbose"
    for text in (_help([console]), _help([sys.executable, "-m", BINARIES[script]])):
        assert defined["doc"].splitlines()[0] in text
        for name, help_text in defined["flags"].items():
            assert f"--{name}" in text or f"--[no]{name}" in text, name
            # absl wraps the help text; its first words are on the flag's first line.
            assert " ".join(help_text.split()[:4]) in " ".join(text.split()), name
