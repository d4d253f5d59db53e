"""Tests of tools.plot_results on synthetic result.json files."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from tools import benchlib, plot_results


def write_results(logdir, rows):
    logdir.mkdir(parents=True)
    with open(logdir / "result.json", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.write("\n")  # A trailing blank line, as an interrupted writer may leave.
    return str(logdir)


def _rows(n, with_wall_clock):
    rows = []
    for i in range(n):
        row = {
            "timesteps_total": 1000 * (i + 1),
            "time_total_s": 10.0 * (i + 1),
            "episode_reward_mean": float("nan") if i == 0 else 20.0 * i,
            "training_iteration": i + 1,
        }
        if with_wall_clock:
            row["time_since_start_s"] = 10.0 * (i + 1) + 7.0
        rows.append(row)
    return rows


def test_load_run_prefers_wall_clock_time(tmp_path):
    run = plot_results.load_run(write_results(tmp_path / "a", _rows(4, with_wall_clock=True)))
    assert run.label == "a"
    assert run.time_key == "time_since_start_s"
    np.testing.assert_array_equal(run.steps, [1000, 2000, 3000, 4000])
    np.testing.assert_array_equal(run.seconds, [17, 27, 37, 47])
    assert math.isnan(run.returns[0])
    np.testing.assert_array_equal(run.returns[1:], [20, 40, 60])

    # Without time_since_start_s (e.g. results from RLlib) the time inside train() is used.
    path = write_results(tmp_path / "b", _rows(3, with_wall_clock=False))
    run = plot_results.load_run(os.path.join(path, "result.json"), label="rllib")
    assert (run.label, run.time_key) == ("rllib", "time_total_s")
    np.testing.assert_array_equal(run.seconds, [10, 20, 30])


def test_plot_draws_one_line_per_run_on_both_panels(tmp_path):
    runs = [
        plot_results.load_run(write_results(tmp_path / "a", _rows(4, True)), "adam"),
        plot_results.load_run(write_results(tmp_path / "b", _rows(6, False)), "rmsprop"),
    ]
    fig = plot_results.plot_runs(runs, title="CartPole")
    by_steps, by_time = fig.axes
    assert [line.get_label() for line in by_steps.lines] == ["adam", "rmsprop"]
    np.testing.assert_array_equal(by_steps.lines[1].get_xdata(), runs[1].steps)
    np.testing.assert_array_equal(by_time.lines[0].get_xdata(), runs[0].seconds)
    np.testing.assert_array_equal(by_time.lines[1].get_ydata(), runs[1].returns)
    assert "time_since_start_s" in by_time.get_xlabel()
    assert "time_total_s" in by_time.get_xlabel()


def test_main_writes_a_png(tmp_path, capsys):
    a = write_results(tmp_path / "a", _rows(4, True))
    b = write_results(tmp_path / "b", _rows(5, True))
    out = tmp_path / "curves.png"
    assert plot_results.main([a, b, f"--out={out}", "--labels=first,second"]) == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert "first: best 60.0" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No result.json"),
        ("", "holds no results"),
        ("{not json\n", "result.json:1: not a JSON line"),
        ('{"episode_reward_mean": 1.0}\n', "needs `timesteps_total`"),
    ],
)
def test_main_explains_bad_logdirs(tmp_path, capsys, content, message):
    logdir = tmp_path / "run"
    logdir.mkdir()
    if content is not None:
        (logdir / "result.json").write_text(content)
    with pytest.raises(SystemExit):
        plot_results.main([str(logdir), f"--out={tmp_path / 'x.png'}"])
    assert message in capsys.readouterr().err


def test_main_checks_the_label_count(tmp_path, capsys):
    a = write_results(tmp_path / "a", _rows(2, True))
    with pytest.raises(SystemExit):
        plot_results.main([a, f"--out={tmp_path / 'x.png'}", "--labels=x,y"])
    assert "--labels has 2 entries for 1 logdirs" in capsys.readouterr().err


def test_thresholds_report_the_first_result_reaching_each_return(tmp_path):
    # Returns: nan, 20, 40, 60, 80 at 1000..5000 steps and 10..50 s.
    run = plot_results.load_run(write_results(tmp_path / "a", _rows(5, with_wall_clock=False)))
    assert plot_results.first_reaching(run, 40.0) == (3000.0, 30.0)
    assert plot_results.first_reaching(run, 41.0) == (4000.0, 40.0)
    assert plot_results.first_reaching(run, 81.0) is None
    table = plot_results.thresholds_table([run], [40.0, 81.0])
    assert "| a | 0.5 min, 0.00M steps | not reached | 80.0 |" in table


def test_section_writes_the_thresholds_table(tmp_path, monkeypatch):
    logdir = write_results(tmp_path / "a", _rows(5, with_wall_clock=False))
    written = {}
    monkeypatch.setattr(benchlib, "write_section", lambda name, text: written.update({name: text}))
    out = str(tmp_path / "c.png")
    assert plot_results.main([logdir, "--out", out, "--thresholds", "60", "--section", "s"]) == 0
    assert "first >= 60" in written["s"] and "0.7 min" in written["s"]
