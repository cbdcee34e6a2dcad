"""A relay's tolerance (pulse.py): how long its pulse may be silent before a peer takes it for
stopped, from how late its pulse thread ran recently."""

from __future__ import annotations

from pathlib import Path

from notify_outbox.relay.pulse import (
    FACTOR,
    TOLERANCE_CEILING,
    Lateness,
    cpu_quota_period,
    least_tolerance,
    tagged,
    tolerance_for,
)


def test_the_tolerance_is_the_timeout_until_the_pulse_ran_late() -> None:
    assert tolerance_for(0.15, 0.0) == 0.15
    # Three times a delay of up to 50 ms is within the 0.15 s timeout: as before.
    assert tolerance_for(0.15, 0.05) == 0.15
    assert tolerance_for(0.15, 0.1) == 0.3
    # Rounded up to 50 ms steps: few distinct statement texts.
    assert tolerance_for(0.15, 0.101) == 0.35
    assert FACTOR * 0.101 <= 0.35
    # At most the ceiling (PostgreSQL's idle timeout ends such a claim anyway), never less
    # than the relay's own setting.
    assert tolerance_for(0.15, 1.9) == TOLERANCE_CEILING
    assert tolerance_for(5.0, 0.5) == 5.0


def test_lateness_keeps_the_worst_of_its_recent_samples_and_leaves_freezes_out() -> None:
    late = Lateness(window=4)
    assert late.worst() == 0.0
    late.add(0.3)
    late.add(0.01)
    assert late.worst() == 0.3
    # A freeze (SIGSTOP, a VM pause) is no delay to allow for.
    late.add(TOLERANCE_CEILING)
    late.add(6.0)
    assert late.worst() == 0.3
    # It lasts at least a window of samples after it came, and at most two.
    for _ in range(2):
        late.add(0.01)
    assert late.worst() == 0.3  # the first bucket is full: 0.3 is in the previous one now
    for _ in range(3):
        late.add(0.02)
    assert late.worst() == 0.3
    late.add(0.02)
    assert late.worst() == 0.02


def test_a_statement_carries_its_tolerance_at_its_start() -> None:
    assert tagged("SELECT 1", 0.15) == "/* notify-outbox tolerance_ms=150 */ SELECT 1"
    assert tagged("SELECT 1", 1.35).startswith("/* notify-outbox tolerance_ms=1350 */")


def _tree(root: Path, files: dict[str, str], cgroup: str) -> tuple[str, str]:
    for name, text in files.items():
        (root / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "fs" / name).write_text(text)
    (root / "cgroup").write_text(cgroup)
    return str(root / "cgroup"), str(root / "fs")


def test_the_cpu_quota_period_is_read_from_cgroup_v2_and_its_ancestors(tmp_path: Path) -> None:
    # A container's own cgroup (namespaced: "/"), a quota of half a CPU per 100 ms.
    assert cpu_quota_period(*_tree(tmp_path / "a", {"cpu.max": "50000 100000\n"}, "0::/\n")) == 0.1
    # No quota.
    assert cpu_quota_period(*_tree(tmp_path / "b", {"cpu.max": "max 100000\n"}, "0::/\n")) is None
    # A pod's quota on the parent, with a longer period than the container's own: the longest.
    files = {"kubepods/pod1/cpu.max": "20000 250000", "kubepods/pod1/c1/cpu.max": "max 100000"}
    assert cpu_quota_period(*_tree(tmp_path / "c", files, "0::/kubepods/pod1/c1\n")) == 0.25
    # Nothing readable: no quota, no error.
    assert cpu_quota_period(str(tmp_path / "missing"), str(tmp_path)) is None
    files = {"cpu.max": "garbage"}
    assert cpu_quota_period(*_tree(tmp_path / "d", files, "0::/\nnot a line\n")) is None


def test_the_cpu_quota_period_is_read_from_cgroup_v1(tmp_path: Path) -> None:
    files = {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "500000\n",
    }
    cgroup = "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"
    assert cpu_quota_period(*_tree(tmp_path / "a", files, cgroup)) == 0.5
    # Inside a container without a cgroup namespace: the host's path in /proc/self/cgroup, the
    # container's own cgroup at the mount point.
    files = {"cpu/cpu.cfs_quota_us": "10000", "cpu/cpu.cfs_period_us": "100000"}
    assert cpu_quota_period(*_tree(tmp_path / "b", files, "3:cpu:/docker/xyz\n")) == 0.1
    files = {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}
    assert cpu_quota_period(*_tree(tmp_path / "c", files, "3:cpu:/\n")) is None


def test_a_relay_under_a_cpu_quota_is_tolerated_two_periods_at_the_least() -> None:
    assert least_tolerance(0.15, None) == 0.15
    # Kubernetes' default period (100 ms): 0.2 s.
    assert least_tolerance(0.15, 0.1) == 0.2
    assert least_tolerance(0.15, 0.5) == 1.0
    # Never above the ceiling (PostgreSQL's idle timeout), never below the setting.
    assert least_tolerance(0.15, 5.0) == TOLERANCE_CEILING
    assert least_tolerance(0.5, 0.1) == 0.5
    # The tolerance learned from lateness starts from it.
    assert tolerance_for(least_tolerance(0.15, 0.5), 0.1) == 1.0
