"""Make ``edo_monitor.agent`` and ``edo_monitor.tui`` importable from a source checkout.

An install maps the top-level ``agent/`` and ``tui/`` folders into the ``edo_monitor`` package
(``[tool.setuptools.package-dir]``). When Python imports ``edo_monitor`` from the checkout itself
(the repository root is the current folder, or on ``sys.path``), the checkout's ``edo_monitor/``
folder shadows the installed package and has no such subpackages; this maps the folders beside it
the same way. In an installed package the subpackages are inside ``edo_monitor/`` and nothing
happens.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _map(name: str) -> None:
    full = f"edo_monitor.{name}"
    folder = _PACKAGE.parent / name
    if full in sys.modules or (_PACKAGE / name).is_dir() or not (folder / "__init__.py").is_file():
        return
    spec = importlib.util.spec_from_file_location(
        full, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    setattr(sys.modules["edo_monitor"], name, module)


for _name in ("agent", "tui"):
    _map(_name)
