"""NVML probe against a fake NVML with pynvml's error semantics."""

from __future__ import annotations

import pytest
from fakes.nvml import FakeGpu, FakeNvml

from edo_monitor.probes.nvml import NvmlProbe, parse_visible_devices, resolve_nvml_uuid

U0 = "GPU-11111111-aaaa-bbbb-cccc-000000000000"
U1 = "GPU-22222222-aaaa-bbbb-cccc-000000000001"
U2 = "GPU-33333333-aaaa-bbbb-cccc-000000000002"
PID = 4242


def three_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(U0, used=1_000, processes=[(PID, 700)]),
        FakeGpu(U1, used=2_000, processes=[(PID, 900)]),
        FakeGpu(U2, used=3_000, processes=[(7, 5), (PID, 1_100)]),
    ]


def probe(nvml: FakeNvml, index: int = 0, visible: str | None = None) -> tuple[NvmlProbe, list]:
    events: list[tuple[str, str, dict]] = []
    p = NvmlProbe(
        index,
        nvml=nvml,
        visible_devices=visible,
        pid=PID,
        on_event=lambda k, m, d: events.append((k, m, dict(d))),
    )
    p.start()
    return p, events


def test_memory_info_v2_values() -> None:
    nvml = FakeNvml(three_gpus())
    p, events = probe(nvml)
    r = p.read()
    gpu = nvml.gpus[0]
    assert r["device_total_bytes"] == gpu.total
    assert r["device_used_bytes"] == gpu.used
    assert r["device_free_bytes"] == gpu.total - gpu.used - gpu.reserved
    assert r["nvml_memory_info_version"] == 2
    assert r["process_device_bytes"] == 700
    assert p.device_uuid == U0 and p.device_name == "NVIDIA H200"
    assert events == []


def test_library_missing_makes_source_unavailable() -> None:
    p, events = probe(FakeNvml(three_gpus(), library_missing=True))
    assert not p.available
    assert "NVML Shared Library Not Found" in p.reason
    assert all(v is None for v in p.read().values())
    assert [e[0] for e in events] == ["probe_unavailable"]


def test_driver_library_mismatch_is_unavailable() -> None:
    p, _ = probe(FakeNvml(three_gpus(), driver_mismatch=True))
    assert not p.available and "mismatch" in p.reason.lower()


def test_missing_v2_function_falls_back_to_v1() -> None:
    nvml = FakeNvml(three_gpus(), has_v2=False)
    p, events = probe(nvml)
    r = p.read()
    assert r["nvml_memory_info_version"] == 1
    assert r["device_used_bytes"] == nvml.gpus[0].used
    assert r["device_free_bytes"] == nvml.gpus[0].total - nvml.gpus[0].used
    assert len(events) == 1 and "v2" in events[0][1]
    p.read()
    assert len(events) == 1  # reported once


def test_binding_error_that_is_not_nvmlerror_falls_back() -> None:
    p, events = probe(FakeNvml(three_gpus(), v2_binding_error=True))
    r = p.read()
    assert r["nvml_memory_info_version"] == 1
    assert "NVMLLibraryMismatchError" in events[0][1]


def test_not_supported_memory_info_gives_none_and_goes_on() -> None:
    gpus = three_gpus()
    gpus[0].memory_not_supported = True
    p, events = probe(FakeNvml(gpus))
    assert p.read()["device_total_bytes"] is None
    assert p.read()["device_total_bytes"] is None
    assert p.available  # NotSupported is per field, not the whole source
    assert len([e for e in events if "not supported" in e[1]]) == 1


def test_mig_device_process_list_not_supported() -> None:
    gpus = [FakeGpu("MIG-aaaaaaaa-0000-0000-0000-000000000000", mig=True)]
    p, events = probe(FakeNvml(gpus), visible="MIG-aaaaaaaa-0000-0000-0000-000000000000")
    r = p.read()
    assert r["device_total_bytes"] == gpus[0].total
    assert r["process_device_bytes"] is None
    assert len([e for e in events if "process list unavailable" in e[1]]) == 1  # reported once


def test_process_with_unavailable_memory() -> None:
    gpus = [FakeGpu(U0, processes=[(PID, None)])]
    p, events = probe(FakeNvml(gpus))
    assert p.read()["process_device_bytes"] is None
    assert len([e for e in events if "per-process memory not available" in e[1]]) == 1


def test_process_not_in_list_container_pid() -> None:
    gpus = [FakeGpu(U0, processes=[(1, 100)])]
    p, events = probe(FakeNvml(gpus))
    assert p.read()["process_device_bytes"] is None
    assert len([e for e in events if "PID namespace" in e[1]]) == 1  # reported once


def test_device_lost_after_n_samples() -> None:
    gpus = three_gpus()
    gpus[0].lost_after_reads = 3
    p, events = probe(FakeNvml(gpus))
    values = [p.read()["device_total_bytes"] for _ in range(5)]
    assert values == [gpus[0].total] * 3 + [None, None]
    assert not p.available and "lost" in p.reason
    assert sum("lost" in e[1] for e in events) == 1


@pytest.mark.parametrize(
    ("visible", "torch_index", "expected"),
    [
        (None, 1, U1),
        ("2,0,1", 0, U2),
        ("2,0,1", 2, U1),
        (f"{U2},{U0}", 1, U0),  # full UUIDs
        ("GPU-3333,GPU-1111", 0, U2),  # short UUID prefixes
        ("1,,0", 0, U1),  # an empty entry ends the list
    ],
)
def test_uuid_mapping_under_cuda_visible_devices(
    visible: str | None, torch_index: int, expected: str
) -> None:
    nvml = FakeNvml(three_gpus())
    nvml.nvmlInit()
    assert resolve_nvml_uuid(nvml, torch_index, visible) == expected
    p, _ = probe(FakeNvml(three_gpus()), torch_index, visible)
    assert p.device_uuid == expected
    used = {U0: 1_000, U1: 2_000, U2: 3_000}[expected]
    assert p.read()["device_used_bytes"] == used


def test_torch_uuid_wins_over_environment() -> None:
    nvml = FakeNvml(three_gpus())
    nvml.nvmlInit()
    assert resolve_nvml_uuid(nvml, 0, "0", torch_uuid=U1.removeprefix("GPU-")) == U1


@pytest.mark.parametrize(
    ("visible", "message"),
    [
        ("5", "NVML sees 3"),
        ("GPU-9999", "matches no"),
        ("0", "makes 1 visible"),
        ("abc", "not an index"),
    ],
)
def test_bad_mapping_is_unavailable_with_reason(visible: str, message: str) -> None:
    index = 1 if message == "makes 1 visible" else 0
    p, _ = probe(FakeNvml(three_gpus()), index, visible)
    assert not p.available and message in p.reason


def test_ambiguous_prefix() -> None:
    nvml = FakeNvml(three_gpus())
    nvml.nvmlInit()
    with pytest.raises(LookupError, match="matches 3"):
        resolve_nvml_uuid(nvml, 0, "GPU-")


def test_parse_visible_devices() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == []
    assert parse_visible_devices(" 1, 0 ") == ["1", "0"]


# --- impossible values, odd names, a driver that stops answering (issue 9, item 10)


@pytest.mark.parametrize(
    ("used", "shown"),
    [
        (2**64 - 1, "NVML_VALUE_NOT_AVAILABLE"),  # a binding that passes the driver's N/A through
        (150_000_000_001, "> device total 150000000000"),  # one byte more than the device has
        (2**63, "outside 0 .. 2**63-1"),
    ],
)
def test_impossible_process_memory_is_unknown_with_one_event(used: int, shown: str) -> None:
    gpus = [FakeGpu(U0, processes=[(PID, used)])]
    p, events = probe(FakeNvml(gpus))
    readings = [p.read() for _ in range(3)]
    assert [r["process_device_bytes"] for r in readings] == [None, None, None]
    assert [r["device_total_bytes"] for r in readings] == [150_000_000_000] * 3
    assert p.available
    impossible = [e for e in events if "recorded as unknown" in e[1]]
    assert len(impossible) == 1 and len(events) == 1
    assert shown in impossible[0][1] and impossible[0][2]["field"] == "process_device_bytes"


def test_process_memory_equal_to_the_total_is_kept() -> None:
    gpus = [FakeGpu(U0, processes=[(PID, 150_000_000_000)])]
    p, events = probe(FakeNvml(gpus))
    assert p.read()["process_device_bytes"] == 150_000_000_000
    assert events == []


def test_impossible_device_totals_are_unknown() -> None:
    gpus = [FakeGpu(U0, total=2**64 - 1, used=1_000, reserved=0, processes=[(PID, 700)])]
    p, events = probe(FakeNvml(gpus))
    r = p.read()
    assert r["device_total_bytes"] is None
    # free (2**64 - 1 - 1000) is beyond the int64 range as well; used (1000) cannot be checked
    # against an unknown total but fits
    assert r["device_free_bytes"] is None and r["device_used_bytes"] == 1_000
    assert p.available and len(events) == 2
    assert [e[2]["field"] for e in events] == ["device_total_bytes", "device_free_bytes"]


def test_undecodable_device_name_keeps_the_source_with_torchs_name() -> None:
    gpus = [FakeGpu(U0, name=b"NVIDIA \xff\xfe H200", processes=[(PID, 700)])]
    events: list[tuple[str, str, dict]] = []
    p = NvmlProbe(
        0,
        nvml=FakeNvml(gpus),
        visible_devices=None,
        pid=PID,
        on_event=lambda k, m, d: events.append((k, m, dict(d))),
        fallback_name="NVIDIA H200 (torch)",
    )
    assert p.start()
    assert p.available and p.device_name == "NVIDIA H200 (torch)"
    assert p.read()["process_device_bytes"] == 700
    assert len(events) == 1 and "UnicodeDecodeError" in events[0][1]


def test_undecodable_device_name_without_fallback_is_none() -> None:
    gpus = [FakeGpu(U0, name=b"\xc3\x28GPU")]
    p, events = probe(FakeNvml(gpus))
    assert p.available and p.device_name is None
    assert [e[2]["field"] for e in events] == ["name"]
    assert p.read()["device_total_bytes"] == gpus[0].total


@pytest.mark.parametrize("after", [0, 3])
def test_driver_mismatch_after_init_reports_the_real_cause_once(after: int) -> None:
    nvml = FakeNvml(three_gpus(), mismatch_after_reads=after)
    p, events = probe(nvml)
    values = [p.read()["device_total_bytes"] for _ in range(after + 3)]
    assert values == [nvml.gpus[0].total] * after + [None] * 3
    assert not p.available
    assert len(events) == 1  # no "memory info v2 unavailable" first
    assert "versions do not match" in events[0][1]
    assert "NVMLError_LibRmVersionMismatch" in events[0][1]
    assert "v2" not in events[0][1]


def test_driver_mismatch_at_init_names_the_cause() -> None:
    p, events = probe(FakeNvml(three_gpus(), driver_mismatch=True))
    assert len(events) == 1 and "versions do not match" in p.reason
