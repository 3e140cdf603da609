"""Every package folder of the source tree is in pyproject.toml's explicit `packages` list: a
regular install (what CI and users get) leaves out a folder that is not listed, and the
restructure's new `edo_monitor.surfaces.cli` was missing (every CLI test failed to import)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed() -> None:
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("tests run from a checkout")
    listed = set(tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "edo_monitor").rglob("__init__.py")
    }
    found |= {"edo_monitor.agent", "edo_monitor.tui"}  # mapped by package-dir
    assert found - listed == set()
    assert listed - found == set()
