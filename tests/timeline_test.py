"""The start-up/shut-down timeline: marks counted from the process's start."""

import subprocess
import sys
import time

from impala_tf.utils import timeline


def test_a_fresh_process_counts_from_its_own_start():
    # A child that sleeps 1 s before its first mark: the mark is ~1 s plus the interpreter's
    # start, never less (a clock counted from the import would say ~0).
    code = (
        "import time; time.sleep(1.0)\n"
        "from impala_tf.utils import timeline\n"
        "timeline.mark('slept'); timeline.mark('then'); print(timeline.summary())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    (first, second) = out.split(", ")
    assert first.startswith("slept ") and second.startswith("then "), out
    slept, then = float(first.split()[1]), float(second.split()[1])
    assert 1.0 <= slept <= then < 30, out


def test_marks_are_in_order_and_after_the_start():
    timeline.mark("a")
    time.sleep(0.02)
    timeline.mark("b")
    (a, ta), (b, tb) = timeline.marks()[-2:]
    assert (a, b) == ("a", "b") and 0 < ta < tb
    assert timeline.process_start_time() < time.time() - ta + 0.05
