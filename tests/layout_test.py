"""The package's layout: layers that import only downwards, a root with no modules, and the
module paths from before the layout still importing as the same modules."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

from impala_tf.utils.moved_modules import MOVED

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "impala_tf"

#: Bottom to top (docs/architecture.md, "Layers"): a module imports modules of its own layer or
#: of the layers before it.
LAYERS = (
    "utils",
    "config",
    "data",
    "multi_agent",
    "envs",
    "models",
    "acting",
    "rollout",
    "workers",
    "learning",
    "appo",
    "checkpoints",
    "driver",
    "training",
    "tune",
    "bin",
)

#: The upward imports there are, each inside a function (so importing the lower module does not
#: import the upper one), and why.
UPWARD = {
    # `ImpalaConfig.build()`: the config facade builds the algorithm.
    ("impala_tf.config", "impala_tf.driver.factory"),
    # `AlgorithmConfig.learner_class()` / `learner_spec()`: how an algorithm names its learner.
    ("impala_tf.config.base", "impala_tf.learning.learner"),
    ("impala_tf.config.base", "impala_tf.learning.spec"),
    # Validation registers the shipped env ids, reads Atari ids and resolves custom models.
    ("impala_tf.config.validation", "impala_tf.envs"),
    ("impala_tf.config.validation", "impala_tf.envs.atari"),
    ("impala_tf.config.validation", "impala_tf.models.spec"),
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        yield name.removesuffix(".__init__"), path


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.count(".") == 1 and node.module.split(".")[1] in LAYERS:
                yield node.module
            elif node.module == "impala_tf":
                yield from (f"impala_tf.{alias.name}" for alias in node.names)
            else:
                yield node.module


def test_every_package_module_belongs_to_a_layer():
    assert [p.name for p in PACKAGE.glob("*.py")] == ["__init__.py"]
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS)


def test_layers_import_only_downwards():
    upward = set()
    for module, path in _modules():
        here = _layer(module)
        for target in _imports(path):
            there = _layer(target) if target.startswith("impala_tf.") else None
            if here and there and LAYERS.index(there) > LAYERS.index(here):
                upward.add((module, target))
    assert upward == UPWARD


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_are_the_same_modules(old):
    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert module.__name__ == MOVED[old] and module.__spec__.name == MOVED[old]


def test_top_level_names_still_resolve():
    import impala_tf

    for name in impala_tf.__all__:
        assert getattr(impala_tf, name) is not None
    assert impala_tf.vtrace is importlib.import_module("impala_tf.learning.vtrace")
    assert impala_tf.callbacks is importlib.import_module("impala_tf.training.callbacks")


def test_the_config_readers_table_is_generated_and_current():
    from tools import config_readers

    found = config_readers.readers()
    assert "lr" in found["impala_tf/learning/spec.py"]
    assert "num_env_runners" in found["impala_tf/driver/specs.py"]
    assert not any(module.startswith("impala_tf/config/") for module in found)
    assert config_readers.main(["--check"]) == 0


def test_no_package_module_is_over_500_lines():
    long = {name: n for name, path in _modules() if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}
