"""The ``CliRunner`` the CLI tests share: click < 8.2 mixes stderr into stdout unless told not to
(``.ci/lowest-deps`` runs click 8.1), and later releases have no such option."""

from __future__ import annotations

import inspect

from typer.testing import CliRunner

runner = (
    CliRunner(mix_stderr=False)
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters
    else CliRunner()
)
