"""Benchmarks and run checks for impala_tf, run from the repository root as modules.

Each tool is a module with a command line; run it from the repository root (the working directory
puts `impala_tf`, `tools` and `tests` on the path, so no PYTHONPATH is needed):

    .venv/bin/python -m tools.bench_cartpole --seeds 0 1 --timeout 120

Benchmarks (each rewrites its own section of BENCHMARKS.md unless `--no-write`):

* `tools.bench_atari` - Pong: env, learner and inference bounds, impala-train throughput, the
  run's memory and CPU; `--backend=both` compares the Ray and the local actor pool.
* `tools.bench_cartpole` - CartPole: wall time to return 450 and env steps/s over seeds, beside
  RLlib with `--rllib-python`.
* `tools.bench_pendulum` - Pendulum: time and env steps to -700 and -200, beside RLlib.
* `tools.bench_learner` - learner updates vs bare Keras, 1 vs 2 devices, microbatch memory, GPU,
  XLA, and the `precision` A/B (`--parts bf16`: learner and one-thread actor inference).
* `tools.bench_vtrace` - V-trace against its `tf.scan` baseline (RLlib's recursion, our code)
  and a numpy loop.
* `tools.bench_scaling` - per-actor and learner figures, and where the Ray design stops scaling.
* `tools.bench_driver` - driver intake: the real driver fed by fake actors replaying recorded
  fragments (CartPole, Pong 42 and 84), a stub learner; env steps/s per driver core, bytes/s,
  per-fragment costs, weight broadcasts per second with 128 actors.
* `tools.bench_compare` - this checkout against a baseline checkout, alternating runs: CartPole
  to 450, Pong's trained env steps/s, multi-agent CartPole to 600.
* `tools.bench_robustness` - N fresh, unseeded runs of the README's CartPole command: how many
  reach 450, lasting collapses and dips, times to 450 and to exit counting every run.
* `tools.bench_custom_model` - CartPole with the built-in MLP (numpy actors) against the same
  network as a Keras custom model (TensorFlow actors), alternating: env steps/s.
* `tools.bench_actor_inference` - one actor's CNN inference rate on one TF thread (prints only).
* `tools.bench_gpu` - on a GPU only: learner vs bare Keras with XLA off and on, the learner
  thread's rate and GPU utilisation, Pong end to end; `--dry` prints the plan anywhere.
* `tools.bench_tune` - searches: a 4-trial Tune grid of the CartPole config against the same
  four runs one after another (wall time, every trial to 450), and population-based training
  recovering a trial from a bad learning rate.
* `tools.measure_actor_memory` - Rss, Pss and private memory of actor processes (prints only;
  the figures behind `impala_tf.workers.memory`'s estimates).

Run checks (exit 1 when a check fails):

* `tools.learning_suite` - the shipped tuned examples (every config with `pass_criteria`), three
  fresh seeds each, one run at a time, against their criteria (RLlib's where it has one);
  resumable; `--quick` leaves out Atari. Writes its table to BENCHMARKS.md and
  docs/learning-results.md, and the curves to one figure.
* `tools.soak` - hours of CartPole: memory, step rate and file descriptors stay flat.
* `tools.storm` - actors SIGKILLed every few seconds: the run goes on and nothing leaks.

Figures, plots and generated docs:

* `tools.plot_results` - learning curves from impala-train logdirs, and when they reach a return.
* `tools.config_readers` - the "which module reads which config key" table of
  docs/architecture.md, generated from the code (`--check`: exit 1 when it is stale).

Libraries the tools share (imported as `from tools import benchlib, proclib`):

* `tools.benchlib` - median timing, statistics over runs that count the misses, the machine
  line, BENCHMARKS.md sections.
* `tools.proclib` - the process tree and /proc/<pid> readers (stat, CPU, RSS, fds, threads).

Tools that start other tools or `impala-train` run them as `python -m ...` from the repository
root, so a subprocess imports the same code the tool does.
"""

from __future__ import annotations

__all__: list[str] = []
