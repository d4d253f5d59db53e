"""The README and the docs site agree with the code: commands, config keys, defaults, links."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import numpy as np
import pytest

from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.keys import ALIASES, IGNORED, IGNORED_MODEL, MODEL_DEFAULTS, UNSUPPORTED

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
CONFIGS_PAGE = (ROOT / "docs" / "configs.md").read_text(encoding="utf-8")
FIELDS = {f.name for f in dataclasses.fields(AlgorithmConfig)}


def _quick_start_commands(markdown: str) -> list[str]:
    section = markdown.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_the_readme_quick_start_is_two_commands_the_docs_repeat():
    commands = _quick_start_commands(README)
    assert len(commands) == 2 and all("\n" not in c for c in commands), commands
    train, tests = commands
    assert "impala-train --config=configs/cartpole-impala.yaml" in train
    assert "pytest" in tests
    quickstart = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    assert all(c in quickstart for c in commands)


def test_ci_runs_the_readme_test_command_then_builds_the_docs_strictly():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = _quick_start_commands(README)[1]
    assert test_command in ci
    docs_build = ci.index("mkdocs build --strict")
    assert ci.index(test_command) < docs_build


def test_the_readme_fits_two_screens_and_its_links_resolve():
    assert len(README.splitlines()) < 200
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


#: The headline sentence of the README and the docs index: its figures and the block of
#: BENCHMARKS.md they must come from (`tools.bench_robustness`).
_HEADLINE = re.compile(
    r"in a median\s+([\d.]+) s from process start to exit on 2 CPU cores \((\d+) of (\d+) "
    r"fresh unseeded runs"
)


def _robustness_block() -> str:
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    match = re.search(
        r"<!-- bench_robustness:begin -->(.*?)<!-- bench_robustness:end -->", text, re.S
    )
    assert match, "BENCHMARKS.md has no bench_robustness block"
    return match.group(1)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_headline_figures_are_the_robustness_blocks(page):
    text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
    headline = _HEADLINE.search(text)
    assert headline, f"{page} lost its headline sentence (or this test's pattern)"
    median, reached, runs = headline.groups()
    block = " ".join(_robustness_block().split())
    assert f"reached 450 within 2M env steps: **{reached} of {runs}**" in block
    assert f"process start to exit: median {median} s" in block


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _key_defaults(markdown: str) -> dict[str, str]:
    """{key: its cell in the "default" column} of every table with one."""
    defaults, column = {}, None
    for line in markdown.splitlines():
        if line.startswith("| key |"):
            header = _cells(line)
            column = header.index("default") if "default" in header else None
        elif line.startswith("| `") and column is not None:
            row = _cells(line)
            defaults[row[0].strip("`")] = row[column]
    return defaults


def test_the_configs_page_lists_every_key_with_its_default():
    keys_part, rest = CONFIGS_PAGE.split("## Model keys", 1)
    keys, model = _key_defaults(keys_part), _key_defaults(rest.split("\n## ", 1)[0])
    assert set(keys) == FIELDS
    assert set(model) == set(MODEL_DEFAULTS)
    config = AlgorithmConfig()
    for key, cell in keys.items():
        if key == "model":
            continue
        assert ast.literal_eval(cell.strip("`")) == getattr(config, key), key
    for key, cell in model.items():
        assert ast.literal_eval(cell.strip("`")) == MODEL_DEFAULTS[key], key


@pytest.mark.parametrize(
    "key",
    [*ALIASES, *IGNORED, *UNSUPPORTED, *(f"model.{k}" for k in IGNORED_MODEL)],
)
def test_the_configs_page_names_rllibs_other_keys(key):
    assert f"| `{key}` |" in CONFIGS_PAGE


#: The complete examples the docs pages include: (page, module, arguments for a short run, a
#: line of its output).
EXAMPLES = [
    (
        "custom-models.md",
        "examples.train_custom_model",
        ["--model=keras_subclassed", "--stop-iters=1"],
        "custom model KerasMLP trained",
    ),
    ("callbacks.md", "examples.custom_metrics", ["--stop-iters=1"], "pole angle mean"),
    (
        "using-a-policy.md",
        "examples.use_trained_policy",
        ["--train-iters=1", "--episodes=1"],
        "weight arrays",
    ),
]


@pytest.mark.parametrize("page, module, args, expected", EXAMPLES, ids=[e[1] for e in EXAMPLES])
def test_each_bring_your_own_page_includes_an_example_that_runs(
    page, module, args, expected, monkeypatch, capsys
):
    import importlib
    import sys

    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert f'--8<-- "{module.replace(".", "/")}.py"' in text
    assert f"docs/{page}" in (ROOT / "README.md").read_text(encoding="utf-8")
    # Its `main()` as `python -m` runs it, in this process (TensorFlow and the actors' fork
    # server are already up here; a subprocess would import TensorFlow again).
    monkeypatch.setattr(sys, "argv", [module, *args])
    importlib.import_module(module).main()
    assert expected in capsys.readouterr().out


#: The pages the MkDocs site publishes (docs/benchmarks.md includes BENCHMARKS.md) and the README.
PUBLISHED_PAGES = [
    "README.md",
    "BENCHMARKS.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")),
]

#: What belongs in notes/, not on a published page: {what it is: its pattern}.
HISTORY = {
    "a work session": re.compile(r"\bsessions?[ -]\d+", re.I),
    "an issue number": re.compile(r"\bissues? #?\d+", re.I),
    "a first-person run": re.compile(r"\bmy (runs?|profiling)\b", re.I),
}

#: The only /tmp/ paths a published page may show, and only in code: user examples (a checkpoint
#: a user saves, a logdir a user picks), not our own runs.
USER_EXAMPLE_TMP_PATHS = {"/tmp/cartpole-ckpt", "/tmp/run"}


@pytest.mark.parametrize("page", PUBLISHED_PAGES)
def test_a_published_page_names_no_session_issue_temporary_path_or_run_of_ours(page):
    found, fenced = [], False
    for number, line in enumerate((ROOT / page).read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        for what, pattern in HISTORY.items():
            found += [f"{page}:{number}: {what}: {m.group()!r}" for m in pattern.finditer(line)]
        for m in re.finditer(r"/tmp/[\w.\-/]*", line):
            in_code = fenced or line[: m.start()].count("`") % 2 == 1
            path = m.group().rstrip(".")
            if not (in_code and path in USER_EXAMPLE_TMP_PATHS):
                found.append(f"{page}:{number}: a temporary path: {path!r}")
    assert not found, "history belongs in notes/, not on a published page:\n" + "\n".join(found)


def test_the_architecture_page_starts_from_a_one_process_map_that_trains():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert '--8<-- "examples/one_process.py"' in text
    assert text.index("one_process") < text.index("## Layers")
    from examples import one_process

    out = one_process.main(env_steps=40_000, target=float("inf"))
    assert out["sampled"] >= 40_000
    assert out["updates"] > 0 and 0 < out["trained"] <= out["sampled"]
    assert np.isfinite(out["return"])
