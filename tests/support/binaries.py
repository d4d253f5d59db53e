"""Several runs of one binary in one fresh process, for tests that check what each run prints.

Each start of `impala-evaluate` or `impala-export` spends seconds of CPU importing TensorFlow;
a test module that checks a handful of flag combinations paid that once per combination, and
the suite is CPU-bound. Here the runs go one after another through the binary's own flag
parsing and `main`, in one process started as a job manager starts it (`run_in_background`),
each with its stdout and stderr (file descriptors 1 and 2, so C++ and absl logging too) in its
own log. What only a process of its own shows (the console-script entry point, `--help`, the
exit without teardown) is tested by starting the binary itself (binaries_help_test,
train_binary_test, custom_model_binaries_test).

    runs = run_binary_in_one_process(
        "impala_tf.bin.evaluate",
        {"gif": ["--checkpoint=...", "--video=a.gif"], "missing": ["--checkpoint=nowhere"]},
        cwd=REPO, env=env, log_dir=tmp_path,
    )
    code, output = runs["gif"]
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence

from tests.support.processes import EXIT_WITHOUT_TEARDOWN, kill_session, log_tail, run_in_background

__all__ = ["run_binary_in_one_process"]

_RUNNER = """
import importlib, json, os, sys, traceback
from absl import flags

module_name, plan_path = sys.argv[1], sys.argv[2]
with open(plan_path) as f:
    plan = json.load(f)
binary = importlib.import_module(module_name)
codes = {}
for name, log_path, argv in plan:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        flags.FLAGS.unparse_flags()
        code = binary.main(flags.FLAGS([module_name, *argv]))
    except flags.Error as e:  # As absl's app.run reports a bad flag.
        print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
        code = 1
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (log, *saved):
            os.close(fd)
    codes[name] = code
print(json.dumps(codes), flush=True)
"""


def run_binary_in_one_process(
    module: str,
    runs: Mapping[str, Sequence[str | os.PathLike]],
    *,
    cwd: str | os.PathLike,
    env: Mapping[str, str] | None,
    log_dir: str | os.PathLike,
    timeout_s: float = 300,
) -> dict[str, tuple[int, str]]:
    """Runs the binary `module` (`impala_tf.bin.evaluate`, ...) once per entry of `runs`, in
    order, in one fresh process.

    Args:
      module: The binary's module: it defines the flags and `main(argv) -> exit code`.
      runs: {run name: the binary's arguments}.
      cwd: The process's working directory.
      env: Its whole environment; None inherits this process's.
      log_dir: Where each run's output goes, as `<run name>.log`.
      timeout_s: How long all the runs may take together.

    Returns:
      {run name: (exit code, its output)}.
    """
    log_dir = os.fspath(log_dir)
    plan = [
        [name, os.path.join(log_dir, f"{name}.log"), [os.fspath(a) for a in args]]
        for name, args in runs.items()
    ]
    plan_path = os.path.join(log_dir, f"{module}.runs.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    process_log = os.path.join(log_dir, f"{module}.log")
    process = run_in_background(
        [sys.executable, "-c", _RUNNER + EXIT_WITHOUT_TEARDOWN, module, plan_path],
        cwd,
        env,
        process_log,
    )
    try:
        code = process.wait(timeout=timeout_s)
    finally:
        kill_session(process)
    with open(process_log) as f:
        lines = f.read().strip().splitlines()
    assert code == 0 and lines, f"the runs of {module} ended with {code}: {log_tail(process_log)}"
    codes = json.loads(lines[-1])
    outputs = {}
    for name, log_path, _ in plan:
        with open(log_path) as f:
            outputs[name] = (codes[name], f.read())
    return outputs
