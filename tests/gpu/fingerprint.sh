#!/usr/bin/env bash
# Print a fingerprint (sha256) of what the project's wheel is built from: pyproject.toml and the
# package sources (edo_monitor/, agent/, tui/), by content and path. prepare.sh stores it next to
# the wheels; run.sh compares it with the checkout's, so a stale wheel is never tested silently.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
find pyproject.toml edo_monitor agent tui -type f \
    \( -name '*.py' -o -name '*.tcss' -o -name '*.mako' -o -name 'py.typed' -o -name '*.toml' \) \
    -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum \
    | cut -d' ' -f1
