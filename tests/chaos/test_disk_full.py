"""A full records store while turns run (tests/chaos/disk_full.py): 507 store_full, never a 5xx
of another kind; reads keep working; no acknowledged turn lost, no refused turn kept; deleting
sessions makes room again. The LMDB map runs everywhere; the real full disk (a tmpfs) only where
this process may mount one."""

from __future__ import annotations

import pytest

from tests.chaos.disk_full import DiskFullConfig, DiskFullReport, run

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(120)]


def check(report: DiskFullReport) -> None:
    assert report.fillers > 0
    full = (report.full_status, report.full_code)
    assert full == (507, "store_full"), f"the create that found the store full got {full}"
    assert report.refusals_while_full > 0, f"no turn ever found the store full: {report.codes}"
    errors = report.server_errors
    assert not errors, f"{len(errors)} failures other than store_full, e.g. {errors[:3]}"
    assert report.reads == {"get": 200, "list": 200, "get_filler": 200}
    assert not report.history.lost, f"acknowledged, then lost: {report.history.lost}"
    assert not report.history.wrong, report.history.wrong
    assert not report.history.resurrected, f"refused, kept: {report.history.resurrected}"
    assert report.recovered, "turns still refused after the filler sessions were deleted"


def test_records_map_full(tmp_path):
    check(run(tmp_path, DiskFullConfig(kind="map", map_bytes=3 << 19)))


def test_disk_full(tmp_path):
    report = run(tmp_path, DiskFullConfig(kind="disk", tmpfs_bytes=8 << 20))
    if report.skipped:
        pytest.skip(report.skipped)
    check(report)
