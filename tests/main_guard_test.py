"""Tests of scripts that build and train at module level, without `if __name__ == "__main__":`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, source: str, timeout: float = 300) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_a_script_without_main_guard_trains_with_an_env_class_defined_in_it(tmp_path):
    # Two actors and an aggregation worker, each a child process; the env class lives in the
    # script, so the children get it by value. Each child appends to the marker file if the
    # script re-runs in it.
    result = _run(
        tmp_path,
        """
        import os
        import gymnasium as gym
        from impala_tf import ImpalaConfig

        with open("runs.txt", "a") as f:
            f.write(f"{os.getpid()}\\n")


        class ScriptCartPole(gym.Wrapper):
            def __init__(self, env_config=None):
                super().__init__(gym.make("CartPole-v1"))


        config = (
            ImpalaConfig()
            .environment(ScriptCartPole)
            .env_runners(num_env_runners=2, rollout_fragment_length=10)
            .training(train_batch_size=20, model={"fcnet_hiddens": [8]},
                      num_aggregation_workers=1)
            .reporting(min_time_s_per_iteration=0)
            .resources(num_gpus=0)
        )
        algo = config.build()
        result = algo.train()
        algo.stop()
        print("trained", result["num_env_steps_trained"] > 0, result["num_healthy_workers"])
        """,
    )
    assert result.returncode == 0, result.stderr
    assert "trained True 2" in result.stdout, result.stdout + result.stderr
    assert "BrokenPipeError" not in result.stderr
    assert len((tmp_path / "runs.txt").read_text().split()) == 1  # Only the script itself.


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("report()", "True"),
        ("if __name__ == '__main__':\n    report()", "False"),
        ("if '__main__' == __name__:\n    x = 1\n    report()", "False"),
        ("def main():\n    report()\n\nmain()", "True"),
        ("def main():\n    report()\n\nif __name__ == '__main__':\n    main()", "False"),
    ],
)
def test_unguarded_module_level_calls_are_told_apart(tmp_path, body, expected):
    source = (
        "from impala_tf.workers.main_guard import unguarded_main_call\n\n"
        "def report():\n    print(unguarded_main_call())\n\n" + body + "\n"
    )
    result = _run(tmp_path, source, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected
