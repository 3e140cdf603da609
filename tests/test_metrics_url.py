"""The Prometheus endpoint's URL under ``watch(metrics_port=)``: one this machine can fetch,
whatever address it binds (real servers, real scrapes)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from test_metrics import linear_and_opt, poll, scrape, train, values

import edo_monitor


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("host", "shown"),
    [
        ("", "127.0.0.1"),  # every interface: the URL was http://:PORT/metrics, unfetchable
        ("0.0.0.0", "127.0.0.1"),
        pytest.param(
            "::1",  # refused: "Address family for hostname not supported"
            "[::1]",
            marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
    ],
)
def test_the_endpoints_url_is_one_this_machine_can_fetch(
    db_path: Path, host: str, shown: str
) -> None:
    model, opt = linear_and_opt()
    with edo_monitor.watch(
        model, opt, db=db_path, interval_s=0.01, metrics_port=0, metrics_host=host
    ) as mon:
        assert mon.metrics_server is not None
        url = mon.metrics_server.url
        assert url == f"http://{shown}:{mon.metrics_server.port}/metrics"
        train(model, opt, 2)
        poll(lambda: list(values(scrape(url), "edo_steps_total").values()) == [2], "2 steps")
