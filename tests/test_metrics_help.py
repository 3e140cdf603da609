"""The help text of each Prometheus metric against what a CPU-budget run really serves."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("torch")
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import linear_and_opt, poll, scrape, train, values

import edo_monitor


@pytest.mark.parametrize("budget", [64 * 1024**2, None])
def test_each_help_says_when_its_metric_has_no_sample_in_cpu_budget_mode(
    db_path: Path, budget: int | None
) -> None:
    """``edo_device_used_bytes`` said "... or the accounted bytes in CPU-budget mode", where it
    has no sample at all. Every metric a CPU-budget run serves without a sample now says so in
    its help, and none that has one says it is CUDA only."""
    cuda_only = "CUDA only: no sample in CPU-budget mode."
    needs_budget = "no sample in CPU-budget mode without a budget"
    model, opt = linear_and_opt()
    with edo_monitor.watch(
        model, opt, db=db_path, budget=budget, interval_s=0.01, metrics_port=0
    ) as mon:
        train(model, opt, 2)
        url = mon.metrics_server.url
        poll(lambda: values(scrape(url), "edo_params_bytes"), "a reading")
        with urllib.request.urlopen(url, timeout=10) as resp:
            families = list(text_string_to_metric_families(resp.read().decode()))
    helps = {f.name: f.documentation for f in families}
    sampled = {f.name for f in families if f.samples}
    assert helps["edo_device_used_bytes"] == (
        "Device memory used by every process, CUDA contexts included (NVML, else "
        "torch.cuda.mem_get_info); the accounted bytes of CPU-budget mode are "
        "edo_in_use_bytes. CUDA only: no sample in CPU-budget mode."
    )
    for name, text in helps.items():
        if name in sampled:
            assert cuda_only not in text, name
        elif budget is None and name in ("edo_budget_bytes", "edo_free_ratio"):
            assert needs_budget in text, name
        elif name == "edo_actions":
            assert "no sample before an action" in text
        else:
            assert cuda_only in text, (name, text)
    assert {"edo_in_use_bytes", "edo_params_bytes", "edo_steps"} <= sampled
    assert ("edo_budget_bytes" in sampled) == (budget is not None)
