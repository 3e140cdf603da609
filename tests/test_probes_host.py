"""Host probe: cgroup limits read from a real folder laid out like ``/sys/fs/cgroup``, and the
process tree's memory by PSS with real forked children holding known allocations."""

from __future__ import annotations

import mmap
import multiprocessing as mp
from multiprocessing.connection import Connection
from pathlib import Path

import psutil
import pytest

from edo_monitor.probes.host import HostProbe, host_memory, read_cgroup_memory

MiB = 2**20
GiB = 2**30
V1_UNLIMITED = 9_223_372_036_854_771_712  # what cgroup v1 shows for "no limit" (4 KiB pages)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(root: Path, *, parent_max: str, leaf_max: str) -> Path:
    """A cgroup v2 mount with ``/user.slice/job-7`` (the process's cgroup) and its parent."""
    write(root / "memory.current", str(10 * GiB))  # the root has no memory.max
    write(root / "user.slice" / "memory.max", parent_max)
    write(root / "user.slice" / "memory.current", str(3 * GiB))
    leaf = root / "user.slice" / "job-7"
    write(leaf / "memory.max", leaf_max)
    write(leaf / "memory.current", str(1536 * MiB))
    write(leaf / "memory.stat", f"anon 1000\nfile 999\ninactive_file {256 * MiB}\nactive_file 5\n")
    proc = root.parent / "proc-self-cgroup"
    write(proc, "0::/user.slice/job-7\n")
    return proc


def test_cgroup_v2_leaf_limit_and_use_less_inactive_cache(tmp_path: Path) -> None:
    proc = v2_tree(tmp_path / "cg", parent_max=str(3 * GiB), leaf_max=str(2 * GiB))
    cg = read_cgroup_memory(tmp_path / "cg", proc)
    assert cg is not None and cg.version == 2
    assert cg.path == tmp_path / "cg" / "user.slice" / "job-7"
    assert cg.limit_bytes == 2 * GiB
    assert cg.usage_bytes == 1280 * MiB  # 1536 MiB current - 256 MiB inactive file cache
    assert cg.available_bytes == 768 * MiB


def test_cgroup_v2_parent_limit_binds_and_max_means_none(tmp_path: Path) -> None:
    proc = v2_tree(tmp_path / "cg", parent_max=str(1 * GiB), leaf_max="max")
    cg = read_cgroup_memory(tmp_path / "cg", proc)
    assert cg is not None and cg.limit_bytes == GiB and cg.available_bytes == 0  # over: clamped
    proc = v2_tree(tmp_path / "cg2", parent_max="max", leaf_max="max\n")
    cg = read_cgroup_memory(tmp_path / "cg2", proc)
    assert cg is not None and cg.limit_bytes is None and cg.available_bytes is None
    assert cg.usage_bytes == 1280 * MiB


def test_cgroup_namespace_or_host_path_falls_back_to_the_mount(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write(root / "memory.max", str(4 * GiB))  # a container's own cgroup, mounted as the root
    write(root / "memory.current", str(GiB))
    for listed in ("0::/\n", "0::/kubepods/burstable/pod1/abc\n"):
        write(tmp_path / "proc", listed)
        cg = read_cgroup_memory(root, tmp_path / "proc")
        assert cg is not None and cg.path == root
        assert (cg.limit_bytes, cg.usage_bytes, cg.available_bytes) == (4 * GiB, GiB, 3 * GiB)


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    mem = root / "memory"
    write(mem / "memory.limit_in_bytes", str(V1_UNLIMITED))
    write(mem / "memory.usage_in_bytes", str(9 * GiB))
    leaf = mem / "docker" / "c0ffee"
    write(leaf / "memory.limit_in_bytes", str(512 * MiB))
    write(leaf / "memory.usage_in_bytes", str(300 * MiB))
    write(leaf / "memory.stat", f"cache 1\ntotal_inactive_file {44 * MiB}\n")
    write(tmp_path / "proc", "12:cpu,cpuacct:/docker/c0ffee\n4:memory:/docker/c0ffee\n1:name=x:/\n")
    cg = read_cgroup_memory(root, tmp_path / "proc")
    assert cg is not None and cg.version == 1 and cg.path == leaf
    assert (cg.limit_bytes, cg.usage_bytes, cg.available_bytes) == (512 * MiB, 256 * MiB, 256 * MiB)
    write(leaf / "memory.limit_in_bytes", str(V1_UNLIMITED))
    cg = read_cgroup_memory(root, tmp_path / "proc")
    assert cg is not None and cg.limit_bytes is None


def test_no_cgroup_is_none(tmp_path: Path) -> None:
    assert read_cgroup_memory(tmp_path / "absent", tmp_path / "absent-proc") is None
    write(tmp_path / "proc", "garbage\n")
    assert read_cgroup_memory(tmp_path, tmp_path / "proc") is None


def test_host_reading_uses_the_smaller_of_machine_and_cgroup(tmp_path: Path) -> None:
    machine = psutil.virtual_memory()
    assert machine.available > 768 * MiB and machine.total > 2 * GiB  # the premise
    proc = v2_tree(tmp_path / "cg", parent_max=str(3 * GiB), leaf_max=str(2 * GiB))
    probe = HostProbe(cgroup_root=tmp_path / "cg", proc_cgroup=proc, slow_interval_s=0)
    r = probe.read()
    assert r["host_limit_bytes"] == 2 * GiB
    assert r["host_available_bytes"] == 768 * MiB
    assert host_memory(tmp_path / "cg", proc) == (768 * MiB, 2 * GiB)
    # a limit above the machine's memory changes nothing: the machine is the smaller
    write(tmp_path / "cg" / "user.slice" / "job-7" / "memory.max", str(2**50))
    write(tmp_path / "cg" / "user.slice" / "memory.max", "max")
    r = probe.read()
    assert r["host_limit_bytes"] == psutil.virtual_memory().total
    assert r["host_available_bytes"] <= psutil.virtual_memory().total


def _hold(conn: Connection, nbytes: int, grandchild_bytes: int) -> None:
    """A forked worker: ``nbytes`` of private, touched memory; optionally its own child."""
    data = b"\x01" * nbytes  # memset: every page resident and private to this process
    kids = []
    if grandchild_bytes:
        ctx = mp.get_context("fork")
        mine, theirs = ctx.Pipe()
        kid = ctx.Process(target=_hold, args=(theirs, grandchild_bytes, 0))
        kid.start()
        kids.append(kid)
        assert mine.recv() == "ready"
    conn.send("ready")
    conn.recv()
    del data
    for kid in kids:
        kid.terminate()
        kid.join()


@pytest.mark.skipif(not hasattr(psutil.Process(), "memory_full_info"), reason="no PSS/USS here")
def test_process_tree_counts_forked_workers_once_by_pss() -> None:
    probe = HostProbe(slow_interval_s=0)
    before = probe.read()
    # this process, and any child another test left running (counted in before and after)
    alone = 1 + len(psutil.Process().children(recursive=True))
    assert probe.tree_processes == alone
    ctx = mp.get_context("fork")
    workers, pipes = [], []
    # two DataLoader-like workers (48 MiB each), the second with a worker of its own (32 MiB)
    for nbytes, grand in ((48 * MiB, 0), (48 * MiB, 32 * MiB)):
        mine, theirs = ctx.Pipe()
        worker = ctx.Process(target=_hold, args=(theirs, nbytes, grand))
        worker.start()
        workers.append(worker)
        pipes.append(mine)
    try:
        for mine in pipes:
            assert mine.poll(60) and mine.recv() == "ready"
        during = probe.read()
        me = psutil.Process()
        members = [me, *me.children(recursive=True)]
        rss_sum = sum(p.memory_info().rss for p in members)
        parent_rss = me.memory_info().rss
    finally:
        for mine in pipes:
            mine.send("go")
        for worker in workers:
            worker.join(60)
    assert probe.tree_processes == alone + 3 == len(members)
    grown = during["process_tree_bytes"] - before["process_tree_bytes"]
    # the 128 MiB the workers hold, plus what each forked child copied on write (a few MiB)
    assert 128 * MiB <= grown <= 128 * MiB + 3 * 16 * MiB
    # RSS would count the parent's pages, shared after fork, once per process
    assert during["process_tree_bytes"] < rss_sum - parent_rss
    # the main process's own RSS does not see the workers
    assert during["process_rss_bytes"] < before["process_rss_bytes"] + 32 * MiB
    after = probe.read()
    assert probe.tree_processes == alone
    assert after["process_tree_bytes"] < before["process_tree_bytes"] + 32 * MiB


def test_tree_is_read_on_its_own_schedule() -> None:
    probe = HostProbe(slow_interval_s=10.0)
    first = probe.read(now_s=100.0)["process_tree_bytes"]
    assert first is not None and first > 0
    # 64 MiB of new pages, touched: a bytes object of that size can reuse heap memory the
    # process freed earlier and still holds (its PSS unchanged after a long test session)
    held = mmap.mmap(-1, 64 * MiB)
    for offset in range(0, 64 * MiB, mmap.PAGESIZE):
        held[offset] = 1
    assert probe.read(now_s=105.0)["process_tree_bytes"] == first  # repeated, not re-read
    assert probe.read(now_s=110.0)["process_tree_bytes"] >= first + 64 * MiB - 8 * MiB
    held.close()


def test_started_probe_reads_the_tree_on_its_own_thread() -> None:
    import threading

    probe = HostProbe(slow_interval_s=0.05)
    probe.start()
    try:
        deadline = 600  # polls of 0.05 s: a hang guard, not a timing bound
        while probe.read()["process_tree_bytes"] is None and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        r = probe.read()
        assert r["process_tree_bytes"] is not None and r["process_tree_bytes"] > 0
        assert "edo-host" in {t.name for t in threading.enumerate()}
    finally:
        probe.close()
    assert "edo-host" not in {t.name for t in threading.enumerate()}
