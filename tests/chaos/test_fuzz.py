"""No request gets a 5xx or hangs (tests/chaos/fuzz.py): Schemathesis over the whole OpenAPI
schema, then malformed JSON, invalid UTF-8 and abused numbers on every route and over the
WebSocket."""

from __future__ import annotations

import pytest

from tests.chaos.fuzz import FuzzConfig, run

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(150)]


def test_fuzzed_requests_never_get_a_server_error(tmp_path):
    report = run(tmp_path, FuzzConfig(max_examples=10, schema_budget_s=35))
    assert report.operations >= 10 and report.schema_requests >= report.operations
    assert report.handmade_requests > 1000
    if report.server_errors:
        errors = "\n".join(report.server_errors[:10])
        pytest.fail(f"{len(report.server_errors)} server errors:\n{errors}")
    assert not report.hangs, f"no answer within the timeout: {report.hangs[:5]}"
