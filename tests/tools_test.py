"""The tools package: every tool imports from the repository root and is listed in its index."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tools

_LIBRARIES = {"benchlib", "proclib"}
_TOOLS = sorted(m.name for m in pkgutil.iter_modules(tools.__path__) if m.name not in _LIBRARIES)


@pytest.mark.parametrize("name", _TOOLS)
def test_a_tool_imports_and_has_a_command_line(name):
    module = importlib.import_module(f"tools.{name}")
    assert callable(module.main), name


def test_the_index_lists_every_tool_and_library():
    for name in [*_TOOLS, *_LIBRARIES]:
        assert f"`tools.{name}`" in tools.__doc__, name
