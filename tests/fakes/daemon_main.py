"""``edo-monitor`` with the fake NVML in place of ``pynvml``: for tests that run the real
command in a subprocess (signals, exit codes) on a machine without a GPU.

    python tests/fakes/daemon_main.py SPEC_JSON daemon --db PATH --interval 0.05

``SPEC_JSON``: ``{"gpus": [{"uuid": ..., "processes": [[pid, bytes], ...], ...}, ...],
"library_missing": false}`` — keyword arguments of :class:`FakeGpu` and :class:`FakeNvml`. Only
the hardware is replaced (``sys.modules["pynvml"]``); the command, its signal handling, the
daemon and its writer are the real ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fakes.nvml import FakeGpu, FakeNvml

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    gpus = [
        FakeGpu(
            **{k: [tuple(p) for p in v] if k.endswith("processes") else v for k, v in g.items()}
        )
        for g in spec.pop("gpus", [])
    ]
    sys.modules["pynvml"] = FakeNvml(gpus, **spec)  # type: ignore[assignment]
    from edo_monitor.surfaces.cli import main

    sys.argv = ["edo-monitor", *sys.argv[2:]]
    main()
