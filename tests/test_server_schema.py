"""schemathesis against the server's own OpenAPI document, in-process over the fake engine (microseconds per token).

schemathesis' engine runs its examples, coverage and fuzzing phases with valid bodies and bodies that break the
schema (negative mode): boundary values, wrong types at every depth, missing fields, unsupported methods. Every
response must be no 5xx, with a status, content type and body the document lists; a body the schema rejects
must get a 4xx (the document claims no more than the handlers enforce) and a body it accepts a 2xx unless the
request is refused for state rather than shape (its prompt passes the context, or it answers tool calls that are
neither replayed nor live, docs/serving.md §4.8). Bounded: ``MAX_EXAMPLES`` per operation and mode, 1,673 requests:
13 s on two idle cores, 42 s with the cores shared by several jobs.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.engine import events, from_schema

from server_util import fake_app

pytestmark = pytest.mark.timeout(300)

MAX_EXAMPLES = 20
STATE_REFUSALS = ("configured context size", "continuation state is not available")


@schemathesis.check
def valid_bodies_accepted(ctx, response, case) -> None:
    """A schema-valid body gets a 2xx, or a 400 for state (the built-in check would take every 400 as a miss)."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    message = response.json()["error"]["message"]
    if not any(s in message for s in STATE_REFUSALS):
        raise AssertionError(f"schema-valid body rejected: {message}")
    return None


@pytest.fixture(scope="module")
def report(tiny_gguf):
    """Run schemathesis once; -> (requests, failures, statuses by operation, seconds)."""
    app, worker = fake_app(tiny_gguf(), ctx=16384, default_max_tokens=16, max_body_bytes=1 << 20)
    try:
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                        max_examples=MAX_EXAMPLES, deterministic=True, database="none")
        schema.config.phases.update(phases=["examples", "coverage", "fuzzing"])
        schema.config.checks.positive_data_acceptance.enabled = False  # valid_bodies_accepted instead
        t0 = time.monotonic()
        n, failures, statuses = 0, [], Counter()
        for ev in from_schema(schema).execute():
            if isinstance(ev, (events.NonFatalError, events.FatalError)):  # an exception escaped the app: a 500
                failures.append(("error", getattr(ev, "label", ""), str(getattr(ev, "info", ev))[:2000]))
            if not isinstance(ev, events.ScenarioFinished):
                continue
            rec = ev.recorder
            for inter in rec.interactions.values():
                n += 1
                if inter.response is not None:
                    statuses[rec.label, inter.response.status_code] += 1
            for case_id, checks in rec.checks.items():
                for c in checks:
                    if c.failure_info is not None:
                        body = rec.cases[case_id].value.body if case_id in rec.cases else None
                        failures.append((c.name, rec.label, str(c.failure_info.failure)[:1000],
                                         json.dumps(body, ensure_ascii=False)[:1000]))
        yield n, failures, statuses, time.monotonic() - t0
    finally:
        worker.stop()


def test_openapi_document(tiny_gguf):
    from ds4_mlx.server.openapi import openapi_document

    paths = set(openapi_document("0")["paths"])
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
            "/v1/models", "/v1/models/{model_id}", "/v1/stats", "/health"} <= paths


def test_schemathesis_finds_nothing(report):
    n, failures, statuses, seconds = report
    print(f"schemathesis: {n} requests in {seconds:.1f} s")
    assert not failures, "\n\n".join(" | ".join(f) for f in failures[:5])
    assert n > 500
    assert not [k for k in statuses if k[1] >= 500]
    # both directions were exercised on every body-taking route: accepted (2xx) and refused (4xx) bodies
    for route in ("chat/completions", "completions", "responses", "messages", "messages/count_tokens"):
        codes = {code for (label, code) in statuses if label == f"POST /v1/{route}"}
        assert 200 in codes and 400 in codes and 405 in codes, (route, codes)
