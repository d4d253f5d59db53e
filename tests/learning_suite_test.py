"""Tests of tools.learning_suite: which configs, criteria, stopping, resuming, the report; one
real impala-train run of a tiny CartPole criterion."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.processes import (
    alive,
    kill_session,
    log_tail,
    run_in_background,
    session_pids,
    wait_for_line,
)
from tools import learning_suite as suite

CARTPOLE = {"episode_reward_mean": 450, "timesteps_total": 2_000_000}
PONG = [
    {"episode_reward_mean": 18, "timesteps_total": 5_000_000},
    {"episode_reward_mean": 0, "time_total_s": 1200},
]


def _point(steps, ret, time_s=None, it=None):
    return {
        "iter": it if it is not None else steps // 1000,
        "steps": steps,
        "time_s": float(steps / 1000 if time_s is None else time_s),
        "wall_s": None,
        "return": ret,
        "learner": {},
    }


def _result(i, steps, ret):
    """One line of result.json, as impala-train writes it (the keys the suite reads)."""
    return {
        "training_iteration": i,
        "timesteps_total": steps,
        "time_total_s": 1.0 * i,
        "time_since_start_s": 5.0 + i,
        "episode_reward_mean": ret,
        "info": {
            "learner": {
                "default_policy": {
                    "learner_stats": {"entropy": 0.5, "vf_explained_var": 0.9, "cur_lr": 0.002}
                }
            }
        },
    }


# Which configs -----------------------------------------------------------------------------------


def test_the_suite_runs_every_shipped_config_with_pass_criteria_and_quick_leaves_out_atari():
    configs = {c.name: c for c in suite.suite_configs()}
    assert set(configs) == {
        "cartpole-impala",
        "cartpole-impala-fake-gpus",
        "cartpole-impala-replay",
        "cartpole-impala-separate-losses",
        "multi-agent-cartpole-impala",
        "stateless-cartpole-impala",
        "pendulum-impala",
        "pong-impala-small",
        "atari-impala",
        # Custom models (examples/custom_models.py).
        "cartpole-impala-keras-model",
        "cartpole-impala-keras-subclassed",
        "stateless-cartpole-impala-custom-rnn",
        "multi-agent-cartpole-impala-custom-models",
        # APPO.
        "cartpole-appo",
        "pong-appo-small",
    }  # Not RLlib's cluster-sized pong-impala.yaml, pong-impala-fast.yaml and pong-appo.yaml.
    atari = {"pong-impala-small", "atari-impala", "pong-appo-small"}
    assert {n for n, c in configs.items() if c.atari} == atari
    order = list(configs)
    assert set(order[-3:]) == atari  # The long runs last.
    assert configs["cartpole-impala"].criteria == (CARTPOLE,)
    assert list(configs["pong-impala-small"].criteria) == PONG
    assert configs["atari-impala"].criteria == (
        {"episode_reward_mean": 200, "timesteps_total": 6_000_000, "time_total_s": 2400},
    )
    assert "num_env_runners=2" in configs["atari-impala"].sets
    # RLlib's 10 s iterations are ~half of multi-agent CartPole's 200k env steps: 1 s here.
    assert configs["multi-agent-cartpole-impala"].sets == ("min_time_s_per_iteration=1",)
    assert suite.DEFAULT_SEEDS == (100, 101, 102)  # Not the tuning seeds 0-2.


def test_stop_flags_stop_the_binary_only_where_every_criterion_is_decided():
    assert suite.stop_flags([CARTPOLE]) == ["--stop_reward=450", "--stop_timesteps=2000000"]
    # Pong: 18 within 5M steps and 0 within 20 minutes; neither limit decides both criteria.
    assert suite.stop_flags(PONG) == ["--stop_reward=18"]
    breakout = {"episode_reward_mean": 200, "timesteps_total": 6e6, "time_total_s": 2400}
    assert suite.stop_flags([breakout]) == [
        "--stop_reward=200",
        "--stop_timesteps=6000000",
        "--stop_time_s=2400.0",
    ]
    fake_gpus = {"episode_reward_mean": 150, "training_iteration": 400}
    assert suite.stop_flags([fake_gpus]) == ["--stop_reward=150", "--stop_iters=400"]


def test_criteria_read_as_text():
    assert suite.describe_criterion(CARTPOLE) == "450 within 2M env steps"
    assert [suite.describe_criterion(c) for c in PONG] == [
        "18 within 5M env steps",
        "0 within 20.0 min of training",
    ]
    assert (
        suite.describe_criterion({"episode_reward_mean": 600, "timesteps_total": 200_000})
        == "600 within 200k env steps"
    )


# Criteria ----------------------------------------------------------------------------------------


def test_a_criterion_is_met_at_the_first_point_within_its_limits():
    curve = [_point(0, None), _point(500_000, 100.0), _point(1_500_000, 460.0)]
    outcome = suite.evaluate(curve, CARTPOLE)
    assert outcome == {"met": True, "at": curve[2]}


def test_a_criterion_is_missed_at_the_first_point_past_a_limit_even_if_it_reaches_the_return():
    curve = [_point(1_900_000, 440.0), _point(2_000_001, 500.0), _point(2_100_000, 500.0)]
    assert suite.evaluate(curve, CARTPOLE) == {"met": False, "at": curve[1]}


def test_a_criterion_is_undecided_until_reached_or_past_its_limit():
    assert suite.evaluate([], CARTPOLE) == {"met": None, "at": None}
    # No finished episode yet (a NaN return, None in the curve) never reaches a threshold.
    assert suite.evaluate(
        [_point(1000, None)], {"episode_reward_mean": -1e9, "timesteps_total": 1e6}
    ) == {
        "met": None,
        "at": None,
    }


def test_time_and_iteration_limits():
    zero_in_20_min = PONG[1]
    late = [_point(4_000_000, -3.0, time_s=1100), _point(4_100_000, 1.0, time_s=1210)]
    assert suite.evaluate(late, zero_in_20_min)["met"] is False
    early = [_point(4_000_000, 0.0, time_s=1199)]
    assert suite.evaluate(early, zero_in_20_min)["met"] is True
    fake_gpus = {"episode_reward_mean": 150, "training_iteration": 400}
    assert suite.evaluate([_point(1, 151.0, it=400)], fake_gpus)["met"] is True
    assert suite.evaluate([_point(1, 151.0, it=401)], fake_gpus)["met"] is False


# Reading results ---------------------------------------------------------------------------------


def test_read_new_results_leaves_a_line_being_written_for_the_next_read(tmp_path):
    path = tmp_path / "result.json"
    first, second = json.dumps(_result(1, 1000, float("nan"))), json.dumps(_result(2, 2000, 30.0))
    path.write_text(first + "\n" + second[:40])
    points, offset = suite.read_new_results(str(path), 0)
    assert [p["steps"] for p in points] == [1000] and points[0]["return"] is None
    assert points[0]["learner"] == {
        "default_policy": {"entropy": 0.5, "vf_explained_var": 0.9, "cur_lr": 0.002}
    }
    assert (points[0]["time_s"], points[0]["wall_s"]) == (1.0, 6.0)
    path.write_text(first + "\n" + second + "\n")
    points, offset = suite.read_new_results(str(path), offset)
    assert [(p["steps"], p["return"]) for p in points] == [(2000, 30.0)]
    assert suite.read_new_results(str(path), offset) == ([], offset)
    assert suite.read_new_results(str(tmp_path / "missing.json"), 0) == ([], 0)


# Resuming ----------------------------------------------------------------------------------------


def test_a_rerun_skips_finished_runs_and_restarts_interrupted_ones(tmp_path):
    config = suite.SuiteConfig("cartpole-impala", "cartpole-impala.yaml", (CARTPOLE,), False)
    finished = tmp_path / "cartpole-impala" / "seed-100"
    finished.mkdir(parents=True)
    (finished / suite.RUN_FILE).write_text("{}")
    interrupted = tmp_path / "cartpole-impala" / "seed-101"
    interrupted.mkdir()
    (interrupted / suite.STARTED_FILE).write_text("{}")
    plan = suite.plan_runs([config], [100, 101, 102], str(tmp_path))
    assert [(seed, why) for _, seed, why in plan] == [(101, "restart"), (102, "new")]
    plan = suite.plan_runs([config], [100, 101, 102], str(tmp_path), rerun=True)
    assert [(seed, why) for _, seed, why in plan] == [
        (100, "rerun"),
        (101, "restart"),
        (102, "new"),
    ]


def test_a_run_left_running_by_a_killed_suite_is_ended_and_no_other_process(tmp_path):
    directory = tmp_path / "cartpole-impala" / "seed-100"
    directory.mkdir(parents=True)
    logdir = str(directory / suite.LOGDIR)
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)", f"--logdir={logdir}"]
    stale = run_in_background(sleeper, tmp_path, None, tmp_path / "stale.log")
    other = run_in_background(sleeper[:3], tmp_path, None, tmp_path / "other.log")
    try:
        # A pid reused by a process that does not name the logdir is left alone.
        (directory / suite.STARTED_FILE).write_text(
            json.dumps({"pid": other.pid, "logdir": logdir})
        )
        assert not suite.end_stale_run(str(directory))
        assert alive(other.pid)
        (directory / suite.STARTED_FILE).write_text(
            json.dumps({"pid": stale.pid, "logdir": logdir})
        )
        assert suite.end_stale_run(str(directory))
        stale.wait(10)
        assert not session_pids(stale.pid)
    finally:
        kill_session(stale)
        kill_session(other)


# Stopping a run ----------------------------------------------------------------------------------


def test_sigint_ends_a_suite_started_with_sigint_ignored(tmp_path):
    # A suite started with `nohup ... &` from a script inherits SIGINT ignored; its handlers
    # must still turn SIGINT into the suite's interrupt, not leave it to end only the run.
    script = (
        "import time\n"
        "from tools import learning_suite\n"
        "learning_suite.install_signal_handlers()\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log = tmp_path / "suite.log"
    proc = run_in_background([sys.executable, "-c", script], root, None, log, ignore_sigint=True)
    try:
        wait_for_line(log, "^ready$", 30, proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    finally:
        kill_session(proc)
    assert proc.returncode != 0
    assert "KeyboardInterrupt: SIGINT" in log.read_text(), log_tail(log)


# A stand-in for impala-train: one result per 0.05 s, the return climbing by 10 per iteration,
# forever, until a signal ends it.
_FAKE_TRAIN = """
import json, sys, time
path = sys.argv[1] + "/result.json"
i = 0
while True:
    i += 1
    with open(path, "a") as f:
        f.write(json.dumps({"training_iteration": i, "timesteps_total": 1000 * i,
                            "time_total_s": 0.05 * i, "episode_reward_mean": 10.0 * i}) + "\\n")
    time.sleep(0.05)
"""


@pytest.mark.parametrize(
    "criterion, met, steps",
    [
        ({"episode_reward_mean": 50, "timesteps_total": 100_000}, True, 5000),
        ({"episode_reward_mean": 1e6, "timesteps_total": 3000}, False, 4000),
    ],
)
def test_a_run_is_ended_once_its_criteria_are_decided(tmp_path, criterion, met, steps):
    logdir = str(tmp_path / "logdir")
    record = suite.run_one(
        [sys.executable, "-c", _FAKE_TRAIN, logdir],
        logdir,
        str(tmp_path / "train.log"),
        [criterion],
        poll_s=0.05,
        own_exit_s=0.0,
        grace_s=10.0,
        started_path=str(tmp_path / suite.STARTED_FILE),
    )
    assert record["stopped_by"] == "criteria decided"
    assert record["passed"] is met
    (outcome,) = record["outcomes"]
    assert outcome["decided"] and outcome["met"] is met and outcome["at"]["steps"] == steps
    assert record["best"]["return"] == max(p["return"] for p in record["curve"])
    assert record["peak_rss_bytes"] > 0 and record["exit_code"] is not None
    started = json.loads((tmp_path / suite.STARTED_FILE).read_text())
    assert not session_pids(started["pid"])


@pytest.mark.parametrize(
    "interrupted_wait, ignores_sigint, returncode",
    [
        # During the wait for it to exit by itself: it still gets SIGINT, and dies of it.
        (0, False, -signal.SIGINT),
        # During the grace after SIGINT, which it ignores: its session is killed at once.
        (1, True, -signal.SIGKILL),
    ],
)
def test_an_interrupt_while_a_run_is_being_stopped_still_ends_it(
    interrupted_wait, ignores_sigint, returncode
):
    # Set either way: as a person's shell starts it, whatever the shell that started pytest
    # ignored (a background job's children inherit an ignored SIGINT).
    handler = "signal.SIG_IGN" if ignores_sigint else "signal.default_int_handler"
    code = (
        "import signal, time\n"
        f"signal.signal(signal.SIGINT, {handler})\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    real_wait, calls = proc.wait, []

    def wait(timeout=None):
        calls.append(timeout)
        if len(calls) == interrupted_wait + 1:
            raise KeyboardInterrupt("SIGINT")
        return real_wait(timeout)

    proc.wait = wait
    try:
        assert proc.stdout.readline() == b"ready\n"  # Its SIGINT handling is in place.
        with pytest.raises(KeyboardInterrupt):
            suite._stop_session(proc, grace_s=30.0, own_exit_s=0.2)
        assert proc.returncode == returncode
        assert not session_pids(proc.pid)
    finally:
        kill_session(proc)
        proc.stdout.close()


def test_a_run_with_no_new_result_is_ended_as_stalled(tmp_path):
    logdir = str(tmp_path / "logdir")
    record = suite.run_one(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        logdir,
        str(tmp_path / "train.log"),
        [CARTPOLE],
        stall_s=0.5,
        poll_s=0.05,
        grace_s=10.0,
    )
    assert record["stopped_by"].startswith("stalled")
    assert not record["passed"] and not record["outcomes"][0]["decided"]
    assert record["curve"] == [] and record["best"] is None


# The report --------------------------------------------------------------------------------------


def _record(config, seed, criteria, curve, commit="abc123"):
    outcomes = []
    for criterion in criteria:
        outcome = suite.evaluate(curve, criterion)
        outcomes.append(
            {
                "criterion": criterion,
                "label": suite.describe_criterion(criterion),
                "met": bool(outcome["met"]),
                "decided": outcome["met"] is not None,
                "at": outcome["at"],
            }
        )
    machine = {
        "cpu": "AMD EPYC",
        "cores": 2,
        "memory_bytes": 24 * 2**30,
        "gpu": "none",
        "python": "3.11.7",
        "tensorflow": "2.21.0",
        "commit": commit,
    }
    return {
        "config": config,
        "seed": seed,
        "criteria": criteria,
        "outcomes": outcomes,
        "passed": all(o["met"] for o in outcomes),
        "best": suite.best_point(curve),
        "curve": curve,
        "stopped_by": "criteria decided",
        "peak_rss_bytes": 1536 * 2**20,
        "other_cores": 0.25,
        "machine": machine,
        "started": "2026-11-25 10:00:00",
    }


def test_the_report_has_a_summary_and_a_row_per_run_and_criterion(tmp_path):
    configs = [
        suite.SuiteConfig("cartpole-impala", "c.yaml", (CARTPOLE,), False),
        suite.SuiteConfig("pong-impala-small", "p.yaml", tuple(PONG), True),
    ]
    records = [
        _record(
            "pong-impala-small",
            100,
            PONG,
            [_point(3_000_000, 1.0, 1000), _point(4_800_000, 18.5, 1500)],
        ),
        _record("cartpole-impala", 101, [CARTPOLE], [_point(1_000_000, 470.0)]),
        _record("cartpole-impala", 100, [CARTPOLE], [_point(600_000, 9.4), _point(2_000_100, 9.3)]),
        _record("cartpole-impala", 102, [CARTPOLE], [_point(1_400_000, 455.0)]),
    ]
    text = suite.report_markdown(records, configs, missing=["pong-impala-small (seed 101)"])
    lines = text.splitlines()
    assert (
        "| cartpole-impala | 450 within 2M env steps | 2/3 | 1,400,000 | 23.3 min | 100, 101, 102 |"
        in lines
    ), "the medians count the miss at its limit (2,000,100 env steps, 33.3 min)"
    assert (
        "| pong-impala-small | 18 within 5M env steps | 1/1 | 4,800,000 | 25.0 min | 100 |" in lines
    )
    assert (
        "| pong-impala-small | 0 within 20.0 min of training | 1/1 | 3,000,000 | 16.7 min | 100 |"
        in lines
    )
    rows = [line for line in lines if line.startswith("| cartpole-impala | 10")]
    tail = "| 1,536 MiB | 0.25 | abc123 |"
    assert rows == [
        "| cartpole-impala | 100 | 450 within 2M env steps | no | - | - | - "
        f"| 9.4 at 600,000 {tail}",
        "| cartpole-impala | 101 | 450 within 2M env steps | yes | 1,000,000 | 16.7 min | - "
        f"| 470.0 at 1,000,000 {tail}",
        "| cartpole-impala | 102 | 450 within 2M env steps | yes | 1,400,000 | 23.3 min | - "
        f"| 455.0 at 1,400,000 {tail}",
    ]
    assert "- Not run yet: pong-impala-small (seed 101)." in text
    assert "AMD EPYC, 2 cores, 24.0 GiB, GPU none, Python 3.11.7, TensorFlow 2.21.0" in text
    # The cartpole rows come first (suite order), though the records came pong first.
    assert text.index("| cartpole-impala | 100 |") < text.index("| pong-impala-small | 100 |")
    suite.plot_suite(records, configs, str(tmp_path / "suite.png"))
    assert (tmp_path / "suite.png").stat().st_size > 0


def test_the_machine_is_described():
    info = suite.machine_info()
    assert info["cores"] == os.cpu_count() and info["memory_bytes"] > 0
    assert info["tensorflow"] and info["gpu"] and info["commit"]


# One real run ------------------------------------------------------------------------------------

_TINY = """
tiny-cartpole:
    env: CartPole-v1
    run: IMPALA
    pass_criteria:
        episode_reward_mean: 15
        timesteps_total: 500000
    config:
        num_env_runners: 1
        num_envs_per_env_runner: 8
        rollout_fragment_length: 25
        train_batch_size: 200
        min_time_s_per_iteration: 0
        model:
            fcnet_hiddens: [16]
"""


def test_a_real_tiny_suite_runs_reports_and_resumes(tmp_path, capsys):
    configs_dir = tmp_path / "configs"
    configs_dir.mkdir()
    (configs_dir / "tiny-cartpole.yaml").write_text(_TINY)
    results = tmp_path / "results"
    argv = ["--configs-dir", str(configs_dir), "--results-dir", str(results), "--no-write"]
    start = time.monotonic()
    assert suite.main([*argv, "--seeds", "7"]) == 0
    elapsed = time.monotonic() - start
    (record,) = suite.load_records(str(results))
    assert record["passed"] and record["seed"] == 7 and record["config"] == "tiny-cartpole"
    assert record["curve"] and record["curve"][-1]["return"] >= 15
    assert "--seed=7" in record["command"] and record["peak_rss_bytes"] > 0
    assert not session_pids(
        json.loads((results / "tiny-cartpole" / "seed-7" / suite.STARTED_FILE).read_text())["pid"]
    )
    out = capsys.readouterr().out
    assert "| tiny-cartpole | 7 | 15 within 500k env steps | yes |" in out
    assert (results / "learning-suite.md").read_text().strip() in out
    assert (results / "learning-suite.png").exists()
    # Resuming: the finished run is skipped; the report is the same.
    start = time.monotonic()
    assert suite.main([*argv, "--seeds", "7"]) == 0
    assert time.monotonic() - start < elapsed / 2
    assert "to run:" not in capsys.readouterr().out
