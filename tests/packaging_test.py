"""The package as a wheel installs it: the shipped configs as package data, found by name, the
LICENSE and metadata, the console scripts."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile

import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.config.shipped import SHIPPED_DIR, resolve_config, shipped_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_shipped_config_resolves_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # No configs/ here.
    expected = os.path.join(SHIPPED_DIR, "cartpole-impala.yaml")
    for given in ("cartpole-impala", "cartpole-impala.yaml", "configs/cartpole-impala.yaml"):
        assert resolve_config(given) == expected, given
    config, stop = ImpalaConfig.from_yaml("cartpole-impala")
    assert config.env == "CartPole-v1" and stop["episode_reward_mean"] == 450
    with pytest.raises(FileNotFoundError, match="shipped: .*cartpole-impala"):
        resolve_config("no-such-config")
    (tmp_path / "cartpole-impala.yaml").write_text("mine: {}\n")
    assert resolve_config("cartpole-impala.yaml") == "cartpole-impala.yaml"  # A file wins.


def test_the_clones_configs_directory_is_the_shipped_one():
    assert os.path.samefile(os.path.join(ROOT, "configs"), SHIPPED_DIR)
    assert "cartpole-impala" in shipped_names() and "pong-impala-small" in shipped_names()


def test_the_wheel_holds_the_configs_the_license_and_the_console_scripts(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), ROOT],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = glob.glob(str(tmp_path / "impala_tf-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {os.path.basename(n)[: -len(".yaml")] for n in names if "/configs/" in n}
    assert shipped == set(shipped_names())
    info = next(n for n in names if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
    assert f"{info}/LICENSE" in names
    archive = zipfile.ZipFile(wheel)
    metadata = archive.read(f"{info}/METADATA").decode()
    assert "License: Apache-2.0" in metadata
    assert "Requires-Dist: gymnasium[classic-control]" in metadata  # render_env's pygame.
    scripts = archive.read(f"{info}/entry_points.txt").decode()
    for script in ("impala-train", "impala-evaluate", "impala-export"):
        assert f"{script} = impala_tf.bin." in scripts
    assert "Apache License" in archive.read(f"{info}/LICENSE").decode()
