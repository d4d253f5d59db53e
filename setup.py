"""Installs impala_tf: RLlib's IMPALA (V-trace actor-learner RL) on TensorFlow 2 and Keras 3."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="impala_tf",
    version="0.1.0",
    description="IMPALA (V-trace actor-learner RL) for TensorFlow 2 / Keras 3, RLlib-compatible",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=find_packages(include=["impala_tf", "impala_tf.*"]),
    # The shipped configs (a clone's top-level `configs/` links here): `impala-train
    # --config=cartpole-impala` finds them by name from any install.
    package_data={"impala_tf": ["configs/*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        "tensorflow==2.21.*",
        # TensorFlow's numpy dtypes (it accepts 0.5.1 up): ml_dtypes 0.7.0 takes 1.3 s to import
        # here against 0.01 s for 0.6.0, in every process that imports TensorFlow.
        "ml_dtypes>=0.5.1,<0.7",
        # Custom models and env creators defined in a user's script travel to the actor
        # processes by value.
        "cloudpickle",
        "numpy",
        "gymnasium>=1.0",
        # Atari: ale-py ships the ROMs and the native vector env; OpenCV resizes frames.
        "ale-py>=0.12",
        "opencv-python-headless",
        "absl-py",
        "pyyaml",
        # TensorFlow 2.21 no longer depends on it; tf.summary needs it.
        "tensorboard",
        # Evaluation videos (`render_env`): GIFs for TensorBoard and impala-evaluate --video;
        # pygame (classic-control) renders the shipped classic envs.
        "pillow",
        "gymnasium[classic-control]",
    ],
    extras_require={
        # Not scikit-learn (the pb2 extra): keras imports it, when installed, in every process
        # that imports TensorFlow (1.1 s each), and the suite starts ~90 such processes.
        "test": [
            "pytest", "pytest-xdist", "ruff", "matplotlib", "hypothesis", "ray[tune]==2.60.0",
            "pettingzoo>=1.24", "wandb", "mlflow-skinny",
            # pygame: the multi-agent CartPole and impala-evaluate --video render real CartPoles.
            "gymnasium[classic-control]",
        ],
        # Actors and aggregation workers on Ray (`actor_backend: ray`).
        "ray": ["ray==2.60.0"],
        # Searches and trials: impala_tf.tune, and impala-train on YAMLs with search spaces.
        "tune": ["ray[tune]==2.60.0"],
        # Population-based bandits (a `scheduler` block of `type: PB2`): Tune's PB2 needs it.
        "pb2": ["ray[tune]==2.60.0", "scikit-learn"],
        # Experiment trackers (impala_tf.training.trackers; --wandb_project, --mlflow_experiment).
        "wandb": ["wandb"],
        "mlflow": ["mlflow-skinny"],
        "tools": ["matplotlib"],
        # Rendering classic-control envs and writing .mp4 videos in impala-evaluate.
        "video": ["gymnasium[classic-control]", "imageio[ffmpeg]"],
        # PettingZoo parallel envs through impala_tf.multi_agent.env.PettingZooParallelEnv.
        "pettingzoo": ["pettingzoo>=1.24"],
        # The documentation site: `mkdocs build --strict` (mkdocs.yml; API pages from docstrings).
        "docs": [
            "mkdocs>=1.6,<2",
            "mkdocs-material>=9.5,<10",
            "mkdocstrings[python]>=1.0,<2",
            "mkdocstrings-python>=2.0,<3",
            # mkdocstrings formats the signatures with it.
            "ruff",
        ],
    },
    entry_points={
        "console_scripts": [
            "impala-train=impala_tf.bin.train:run",
            "impala-evaluate=impala_tf.bin.evaluate:run",
            "impala-export=impala_tf.bin.export:run",
        ],
    },
)
