"""schemathesis over the server's own OpenAPI schema (issue 22, item 8).

Requests generated from ``/openapi.json`` (mm_pipeline/server/openapi_doc.py: the completion
bodies, the answers, the error body) go to the real app in process (ASGI) over a scripted engine,
with the API key on. Checks: no 5xx, and every answer matches the schema (status documented, body
valid). Bounded: a fixed number of examples per operation, derandomized, so it runs in seconds
and the same way every time.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

from mm_pipeline.server import ServerSettings, create_app  # noqa: E402

from tests.mm_pipeline.server.test_error_statuses import ScriptedEngine  # noqa: E402

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 25  # per operation


@pytest.fixture
def api_schema(tmp_path):
    # An app per test: schemathesis' pytest plugin ends every ASGI lifespan it started when a test
    # ends (pytest_runtest_teardown), and an app's lifespan runs once -- its end closes the batch
    # runner and the background responses for good (server/background_drain.py), so a second test
    # on the same app got "the server is shutting down" 503s.
    app = create_app(ScriptedEngine(), ServerSettings(api_key=KEY, files_dir=str(tmp_path / "files"),
                                                      model_name="scripted"))
    return schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)


def _operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def test_the_schema_documents_the_completion_bodies(api_schema):
    """Without them the fuzzer would send empty bodies and test nothing but the 400 for them."""
    ops = {(op.method.upper(), op.path): op for op in _operations(api_schema)}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        assert ops[("POST", path)].body, path


def test_the_api_answers_every_generated_request_within_its_schema(api_schema):
    # the schemathesis pytest plugin's lazy fixture does not run under this pytest: drive it by hand
    for op in _operations(api_schema):
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(op.as_strategy())
        def one(case) -> None:
            case.call_and_validate(headers=AUTH, checks=[not_a_server_error, response_schema_conformance])

        one()
