"""The tools package: every tool imports from the repository root and is listed in its index."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pkgutil

import pytest

import tools

_LIBRARIES = {"benchlib", "proclib"}
_TOOLS = sorted(m.name for m in pkgutil.iter_modules(tools.__path__) if m.name not in _LIBRARIES)


@pytest.mark.parametrize("name", _TOOLS)
def test_a_tool_imports_and_has_a_command_line(name):
    module = importlib.import_module(f"tools.{name}")
    assert callable(module.main), name


def _package_imports(path: str) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from impala_tf... import name` in a file, nested ones
    (inside functions: the tools import lazily) included."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [
        (node.lineno, node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("impala_tf")
        for alias in node.names
    ]


@pytest.mark.parametrize("name", sorted([*_TOOLS, *_LIBRARIES]))
def test_every_import_of_a_tool_resolves_lazy_ones_included(name):
    """A tool imports the package lazily (in the function that needs TensorFlow or Ray), where
    importing the tool does not reach: each such name must still exist."""
    path = os.path.join(os.path.dirname(tools.__file__), f"{name}.py")
    for line, module, attr in _package_imports(path):
        imported = importlib.import_module(module)
        found = hasattr(imported, attr)
        if not found and hasattr(imported, "__path__"):  # `from package import submodule`.
            found = importlib.util.find_spec(f"{module}.{attr}") is not None
        assert found, f"tools/{name}.py:{line}: from {module} import {attr}"


def test_the_index_lists_every_tool_and_library():
    for name in [*_TOOLS, *_LIBRARIES]:
        assert f"`tools.{name}`" in tools.__doc__, name


def test_bench_gpu_prints_its_plan_without_a_gpu_and_refuses_to_measure_on_a_cpu():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = [sys.executable, "-m", "tools.bench_gpu", "--parts", "learner", "pong"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    dry = subprocess.run([*run, "--dry"], capture_output=True, text=True, cwd=root, env=env)
    assert dry.returncode == 0, dry.stderr
    assert "jit_compile_update=True" in dry.stdout and "batch 2,000" in dry.stdout
    assert "mixed_bfloat16" in dry.stdout
    refused = subprocess.run(run, capture_output=True, text=True, cwd=root, env=env)
    assert refused.returncode == 2
    assert "sees none" in refused.stderr and "tools.bench_learner" in refused.stderr


def test_measure_actor_memory_prints_the_guards_estimate_for_both_kinds_of_actor(capsys):
    import gymnasium as gym
    import numpy as np

    from impala_tf.config import ImpalaConfig
    from impala_tf.workers.memory import estimate_pool_bytes
    from tools import measure_actor_memory

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "configs", "cartpole-impala.yaml")
    measure_actor_memory.print_estimate(path)
    out = capsys.readouterr().out
    config, _ = ImpalaConfig.from_yaml(path)
    space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)  # CartPole-v1's observations.
    for label, numpy_policy in (("TensorFlow actors", False), ("actors without TF", True)):
        per_actor = estimate_pool_bytes(config, space, numpy_policy=numpy_policy)["per_actor"]
        (line,) = [line for line in out.splitlines() if label in line]
        assert f"{per_actor / 2**20:7.1f} MiB per actor" in line
