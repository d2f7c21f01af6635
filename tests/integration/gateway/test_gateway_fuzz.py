"""Schemathesis fuzzing of the OpenAPI spec against the real gateway: no input yields a 5xx.

Every operation gets a bounded number of valid-looking (positive) and schema-violating (negative)
examples, keeping this well under 90 s on two cores. The fuzzing key's token bucket is small (300
tokens a minute), so admitted generations stay cheap on the CPU worker; half the generated bodies
get the served model's name and a 2-token completion, so the prompt path (template, tokenizer,
context window, sampling, the worker call) is exercised and not only the 404 of an unknown model.
Driven programmatically: the schemathesis pytest plugin's lazy fixture loader fails under pytest 9.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.support.gateway_stack import MODEL, GatewayStack, Tenant

EXAMPLES_PER_MODE = 20


@pytest.fixture(scope="module")
def fuzz_tenant(gateway_stack: GatewayStack) -> Tenant:
    return gateway_stack.tenant("enterprise", rpm=100_000, tpm=300)


def _fuzz(operation: Any, mode: GenerationMode, url: str, key: str, failures: list[str]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode), real_model=st.booleans())
    @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(case: Any, real_model: bool) -> None:
        if real_model and isinstance(case.body, dict) and "model" in case.body:
            # The served model and a tiny completion: random sampling parameters reach the worker.
            case.body = {**case.body, "model": MODEL, "max_tokens": 2, "max_completion_tokens": None, "n": 1}
        response = case.call(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except Exception as e:  # collect them all: one report names every failing operation
            failures.append(f"{operation.label} [{mode.value}] {response.status_code}: {response.text[:300]}\n"
                            f"  {case.as_curl_command()}\n  {e}")
    try:
        run()
    except Unsatisfiable:  # negative mode on an operation without parameters: nothing to violate
        assert mode is GenerationMode.NEGATIVE, operation.label


def test_no_input_makes_the_gateway_fail(gateway_stack: GatewayStack, fuzz_tenant: Tenant) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway_stack.url}/openapi.json")
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation, mode, gateway_stack.url, fuzz_tenant.key, failures)
    assert not failures, "\n".join(failures[:20])
