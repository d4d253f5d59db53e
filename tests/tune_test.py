"""impala_tf's algorithms as Ray Tune Trainables, on a local Ray: grids, checkpoints through the
algorithm's own, the resources a trial reserves, and every process ended with the trial."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.support.configs import small_config
from tests.support.processes import kill_session, run_in_background, wait_until
from tests.support.ray import local_ray
from tools import proclib

tune = pytest.importorskip("ray.tune")

from impala_tf.tune import IMPALA, trial_resources  # noqa: E402
from impala_tf.tune.search import SearchError, run_search  # noqa: E402

STOP = {"training_iteration": 2}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    with local_ray(str(tmp_path_factory.mktemp("ray-home")), num_cpus=2) as ray:
        yield ray


def _tiny(**overrides):
    """Two trials fit on 2 logical CPUs: 0.5 for the driver, 0.25 for its one actor."""
    overrides = {"num_env_runners": 1, **overrides}
    return small_config(num_cpus_for_main_process=0.5, num_cpus_per_env_runner=0.25, **overrides)


def _actor_processes() -> list[int]:
    """Processes the trials' Ray workers started (their actors, fork servers and resource
    trackers): any descendant of a `ray::` worker process. Ray's own processes, and this test
    process's own fork server and its children, are not the trials'."""
    trials = [
        pid
        for pid in proclib.descendants(os.getpid())
        if (proclib.cmdline(pid) or [""])[0].startswith("ray::")
        and "Agent" not in proclib.cmdline(pid)[0]
    ]
    return sorted({child for pid in trials for child in proclib.descendants(pid)})


def _assert_the_trials_processes_ended() -> None:
    """Waits for the trials' processes to end (their actors at `stop()`, the fork server when
    Tune ends the trial's worker process); names any left with its parent's command line."""
    wait_until(lambda: not _actor_processes(), timeout_s=60)
    leftover = {
        pid: (proclib.cmdline(proclib.parent_pid(pid) or 0), proclib.cmdline(pid))
        for pid in _actor_processes()
    }
    assert leftover == {}


def test_trial_resources_reserve_the_driver_the_actors_and_the_aggregation_workers():
    pgf = trial_resources(
        small_config(num_cpus_per_env_runner=0.5, num_aggregation_workers=1), cluster_gpus=0
    )
    assert pgf.bundles == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 1.0}]
    assert pgf.strategy == "STRICT_PACK"  # Local actor processes: the trial's own node.
    ray_pgf = trial_resources(
        small_config(backend="ray", custom_resources_per_env_runner={"sim": 1}), cluster_gpus=0
    )
    assert ray_pgf.bundles[1:] == [{"CPU": 1.0, "sim": 1.0}] * 2
    assert ray_pgf.strategy == "PACK"
    fake = trial_resources(small_config(num_gpus=2, _fake_gpus=True), cluster_gpus=4)
    assert "GPU" not in fake.bundles[0]
    gpu = small_config(num_gpus=1, num_cpus_for_main_process=2)
    assert trial_resources(gpu, cluster_gpus=4).bundles[0] == {"CPU": 2.0, "GPU": 1.0}
    assert trial_resources(gpu, cluster_gpus=0).bundles[0] == {"CPU": 2.0}  # One CPU device.


def test_the_names_are_registered_again_in_a_new_ray_session(ray_session):
    import ray._private.worker as ray_worker
    from ray.tune.registry import TRAINABLE_CLASS, _global_registry

    # What a `ray.shutdown()` and a new `ray.init()` leave: the store without the names.
    for name in ("impala_tf.IMPALA", "impala_tf.APPO"):
        _global_registry.unregister(TRAINABLE_CLASS, name)
    assert not _global_registry.contains(TRAINABLE_CLASS, "impala_tf.APPO")
    for hook in ray_worker._post_init_hooks:  # What `ray.init` runs once connected.
        hook()
    for name in ("impala_tf.IMPALA", "impala_tf.APPO"):
        assert _global_registry.contains(TRAINABLE_CLASS, name)


def test_save_restore_and_reset_go_through_the_algorithms_checkpoints(ray_session, tmp_path):
    config = _tiny().to_dict()
    first = IMPALA(config=config)
    try:
        first.train()
        steps = first.algorithm.metrics.counters.num_env_steps_sampled
        saved = first.save(str(tmp_path / "ckpt"))
        # Tune's `reuse_actors` (a PBT exploit in this trial's process): another config, then a
        # checkpoint restored; the algorithm built again, the old one's processes ended.
        old = first.algorithm
        assert first.reset({**config, "lr": 0.004})
        assert first.algorithm is not old and old._stopped and not old.actors.workers.pids()
        first.restore(saved)
        assert first.algorithm.metrics.counters.num_env_steps_sampled == steps
        result = first.train()
        stats = result["info"]["learner"]["default_policy"]["learner_stats"]
        assert stats["cur_lr"] == pytest.approx(0.004)
        assert result["training_iteration"] == 2 and result["timesteps_total"] > steps
    finally:
        first.stop()
    restored = IMPALA(config=config)
    try:
        restored.restore(saved)
        assert restored.algorithm.metrics.counters.num_env_steps_sampled == steps
        result = restored.train()
        assert result["timesteps_total"] > steps
    finally:
        restored.stop()


def _start_train_binary(tmp_path, *args: str, **env_vars: str):
    """`impala-train` started as a person starts it, with Ray's files kept in `tmp_path`:
    (the process, its log file)."""
    env = dict(
        os.environ,
        HOME=str(tmp_path),
        PYTHONPATH=REPO,
        TF_CPP_MIN_LOG_LEVEL="2",
        RAY_USAGE_STATS_ENABLED="0",
        **env_vars,
    )
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    log = tmp_path / "log.txt"
    process = run_in_background(
        [sys.executable, "-m", "impala_tf.bin.train", *args], tmp_path, env, log
    )
    return process, log


def _train_binary(tmp_path, *args: str, **env_vars: str) -> tuple[int, str]:
    """`impala-train` run to its end: (exit status, output)."""
    process, log = _start_train_binary(tmp_path, *args, **env_vars)
    try:
        code = process.wait(timeout=600)
    finally:
        kill_session(process)
    return code, log.read_text()


SMALL = (
    "--set=num_env_runners=1",
    "--set=num_envs_per_env_runner=4",
    "--set=rollout_fragment_length=10",
    "--set=train_batch_size=40",
    "--set=min_time_s_per_iteration=0.3",
    "--set=model.fcnet_hiddens=[16]",
    "--set=num_cpus_for_main_process=0.5",
    "--set=num_cpus_per_env_runner=0.25",
    "--ray_num_cpus=2",
)


def test_impala_train_runs_a_yaml_grid_with_tunes_trackers_and_the_same_command_resumes_it(
    tmp_path, monkeypatch
):
    # One search, interrupted and resumed (each run of impala-train starts a Ray and a trial).
    yaml_path = tmp_path / "grid.yaml"
    yaml_path.write_text(
        "grid:\n"
        "    env: CartPole-v1\n"
        "    run: IMPALA\n"
        "    stop: {training_iteration: 6}\n"
        "    config:\n"
        "        lr: {grid_search: [0.001]}\n"
        "        model: {fcnet_hiddens: {grid_search: [[8], [16]]}}\n"
    )
    logdir = tmp_path / "runs" / "grid"
    mlruns = f"file:{tmp_path / 'mlruns'}"
    command = (
        f"--config={yaml_path}",
        f"--logdir={logdir}",
        "--checkpoint_freq=1",
        "--mlflow_experiment=grid",
        f"--mlflow_tracking_uri={mlruns}",
        "--wandb_project=grid",
        *SMALL,
    )
    trackers = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb-runs")}

    def lines(path) -> list[dict]:
        with open(path) as f:
            return [json.loads(line) for line in f]

    def results() -> list:
        return sorted(glob.glob(str(logdir / "*" / "impala_tf" / "result.json")))

    process, log = _start_train_binary(tmp_path, *command, **trackers)
    try:  # Ctrl-C once the trial has results: Tune saves the experiment's state and stops.
        wait_until(lambda: results() and len(lines(results()[0])) >= 2, timeout_s=120)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=120)
    finally:
        kill_session(process)
    out = log.read_text()
    assert code == 130, out[-3000:]
    assert "UNFINISHED" in out and "the same command resumes them" in out
    (trial,) = results()  # `--set=model.fcnet_hiddens` wins over the YAML's grid of it.
    assert len(lines(trial)) < 6
    code, out = _train_binary(tmp_path, *command, **trackers)
    assert code == 0, out[-3000:]
    table = out[out.index("trial ") :]
    assert "lr" in table.splitlines()[0] and "TERMINATED" in table.splitlines()[1]
    assert "impala-train: 1 of 1 trials ended" in out
    # The same trial went on from its checkpoint: one result per iteration.
    assert results() == [trial]
    assert [r["training_iteration"] for r in lines(trial)] == list(range(1, 7))
    # Ray Tune's own MLflow and W&B logger callbacks logged the trial's results (the resumed
    # search's too, in the run of the first or a run of its own).
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in.
    client = MlflowClient(tracking_uri=mlruns)
    runs = client.search_runs([client.get_experiment_by_name("grid").experiment_id])
    logged = {
        m.value
        for run in runs
        for m in client.get_metric_history(run.info.run_id, "training_iteration")
    }
    assert logged == set(range(1, 7)), logged
    assert glob.glob(str(tmp_path / "wandb-runs" / "**" / "offline-run-*"), recursive=True)


def test_a_searchs_driver_makes_tunes_tracker_callbacks_without_importing_tensorflow(tmp_path):
    # The trials import TensorFlow; the process that only drives Tune need not (seconds of CPU
    # and hundreds of MB). MLflow's store comes from the same function as the MLflow logger's.
    code = (
        "import sys\n"
        "from impala_tf.bin._search import _tracker_callbacks\n"
        f"made = _tracker_callbacks('grid', 'project', 'grid', 'file:{tmp_path / 'mlruns'}')\n"
        "assert [type(c).__name__ for c in made] == "
        "['WandbLoggerCallback', 'MLflowLoggerCallback'], made\n"
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules\n"
    )
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=120)


def test_a_search_over_an_experiment_is_refused_without_resume(ray_session, tmp_path):
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "tuner.pkl").write_bytes(b"")  # What Tune keeps of an experiment.
    space = {**_tiny().to_dict(), "lr": tune.grid_search([0.001, 0.002])}
    with pytest.raises(SearchError, match="holds a search; pass --resume"):
        run_search("grid", "IMPALA", space, STOP, storage_path=str(tmp_path), resume=False)


def test_a_search_with_a_trial_larger_than_the_cluster_is_refused(ray_session, tmp_path):
    # impala-train reports a SearchError as it reports any bad config ("impala-train: error:").
    space = {**small_config(num_env_runners=4).to_dict(), "lr": tune.grid_search([0.001, 0.002])}
    with pytest.raises(SearchError) as refused:
        run_search("big", "IMPALA", space, STOP, storage_path=str(tmp_path))
    assert "one trial needs {'CPU': 5.0} but the Ray cluster has {'CPU': 2.0}" in str(refused.value)
    assert "num_cpus_per_env_runner" in str(refused.value)
    assert not (tmp_path / "big").exists()  # Refused before Tune started.


def test_pbt_exploit_copies_a_checkpoint_and_the_new_lr_is_trained_with(ray_session, tmp_path):
    from ray.tune.schedulers import PopulationBasedTraining

    space = _tiny().to_dict()
    space["lr"] = tune.grid_search([0.0, 0.004])  # lr 0 never learns: the trial to replace.
    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        metric="episode_reward_mean",
        mode="max",
        perturbation_interval=2,
        quantile_fraction=0.5,
        resample_probability=1.0,
        synch=True,  # Every trial reaches the perturbation point before any exploit.
        hyperparam_mutations={"lr": [0.001, 0.002]},
    )
    results = tune.Tuner(
        IMPALA,
        param_space=space,
        tune_config=tune.TuneConfig(scheduler=pbt, reuse_actors=True),
        run_config=tune.RunConfig(
            name="pbt",
            storage_path=str(tmp_path),
            stop={"training_iteration": 4},
            verbose=0,
        ),
    ).fit()
    assert not results.errors
    assert len(results) == 2  # One trial per point of the grid.
    with open(tmp_path / "pbt" / "pbt_global.txt") as f:
        exploits = [json.loads(line) for line in f if line.strip()]
    assert exploits  # [target tag, donor tag, target iteration, donor iteration, old, new]
    changed = []  # Each trial's learning rates, as its own result.json shows them.
    for result in results:
        with open(os.path.join(result.path, "impala_tf", "result.json")) as f:
            lrs = [
                json.loads(line)["info"]["learner"]["default_policy"]["learner_stats"]["cur_lr"]
                for line in f
            ]
        if lrs[-1] != lrs[0]:
            changed.append(lrs)
    # The exploited trial trains on with a mutated lr (PBT resamples from the mutations).
    assert changed and all(round(lrs[-1], 6) in (0.001, 0.002) for lrs in changed)
    _assert_the_trials_processes_ended()


def test_pb2_without_scikit_learn_names_the_extra(monkeypatch):
    import importlib.util

    from impala_tf.tune.search import make_scheduler

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install 'impala_tf\[pb2\]'"):
        make_scheduler({"type": "PB2", "hyperparam_bounds": {"lr": [0.001, 0.01]}})


def test_rllibs_unedited_four_game_atari_yaml_is_a_search_of_one_valid_trial_per_game():
    # What impala-train does with the YAML before Tune runs the trials (each trial then trains
    # as a one-game run does: atari_test runs impala-train on each Atari config; the CartPole
    # grid above runs a YAML's trials through impala-train end to end).
    from impala_tf.bin._search import search_request
    from impala_tf.tune.search import _check_points, resolved_points

    rllib_yaml = os.path.join(REPO, "tests", "data", "rllib", "atari-impala.yaml")
    name, algo_name, settings, stop, scheduler = search_request(rllib_yaml, {}, None, {}, 1)
    assert (name, algo_name, stop, scheduler) == ("atari-impala", "IMPALA", {}, None)
    configs = _check_points(algo_name, resolved_points(settings))
    games = ("Breakout", "BeamRider", "Qbert", "SpaceInvaders")
    assert [c.env for c in configs] == [f"{game}NoFrameskip-v4" for game in games]
    for config in configs:  # RLlib's settings, the same in every trial.
        assert config.num_env_runners == 32 and config.num_envs_per_env_runner == 5
        assert (config.rollout_fragment_length, config.train_batch_size) == (50, 500)
        assert config.clip_rewards is True
        assert config.lr_schedule == [[0, 0.0005], [20000000, 1e-12]]


def test_a_trials_ray_actors_run_inside_its_placement_group_and_a_dead_trial_is_restored(
    ray_session, tmp_path
):
    # The trial reserves both of the cluster's CPUs (1.5 + 2 x 0.25): Ray actors placed
    # outside its placement group could not start, and the trial would time out sampling.
    # It is APPO's, by its registered name. Its process dies at its second result (before Tune
    # saves it), once: Tune's fault tolerance restarts the trial from its checkpoint of
    # iteration 1, and the restarted trial's actors again have to fit in its placement group
    # (the dead process's actors gone with it).
    space = _tiny(
        backend="ray",
        sample_timeout_s=30,
        num_env_runners=2,
        callbacks="tests.support.callbacks:ExitOnceAtIterationTwo",
    ).to_dict()
    space.update(num_cpus_for_main_process=1.5, circular_buffer_num_batches=2)  # An APPO key.
    results = tune.Tuner(
        "impala_tf.APPO",
        param_space=space,
        run_config=tune.RunConfig(
            storage_path=str(tmp_path),
            stop=STOP,
            checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1),
            failure_config=tune.FailureConfig(max_failures=1),
            verbose=0,
        ),
    ).fit()
    assert not results.errors
    (result,) = results
    assert result.metrics["training_iteration"] == 2
    assert result.metrics["num_healthy_workers"] == 2
    assert "kl" in json.dumps(result.metrics)  # APPO's learner stats.
    directory = os.path.join(result.path, "impala_tf")
    assert os.path.exists(os.path.join(directory, "exited-once"))
    with open(os.path.join(directory, "result.json")) as f:
        lines = [json.loads(line) for line in f]
    # The restored trial went on from iteration 1's checkpoint: its counters too.
    assert [r["training_iteration"] for r in lines] == [1, 2]
    assert 0 < lines[0]["timesteps_total"] < lines[1]["timesteps_total"]
    assert os.path.isfile(os.path.join(result.checkpoint.path, "driver_state.json"))
    # The trial's processes end with it (Ray's own processes are not ours).
    _assert_the_trials_processes_ended()
