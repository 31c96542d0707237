"""schemathesis against the server's own OpenAPI document: generated requests (valid and not) never get a 5xx.

Runs in-process over the fake engine (microseconds per token), so large generated ``max_tokens`` stay cheap."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from server_util import fake_app

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def schema(tiny_gguf):
    app, worker = fake_app(tiny_gguf(), ctx=256, default_max_tokens=32)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    worker.stop()


def test_openapi_document(schema):
    paths = set(schema.raw_schema["paths"])
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models",
            "/health"} <= paths


def test_no_server_errors(schema):
    failures = []
    for op in schema.get_all_operations():
        operation = op.ok()

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  phases=[Phase.explicit, Phase.generate])
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call()
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))

        check()
    assert not failures, failures[:5]
