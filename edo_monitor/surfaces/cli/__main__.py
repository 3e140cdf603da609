"""``python -m edo_monitor.surfaces.cli``: the ``edo-monitor`` command."""

from edo_monitor.surfaces.cli import main

main()
