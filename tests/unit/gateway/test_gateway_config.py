"""Configuration that must agree with other components, and trace context for gRPC."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider

from services.common.errors import ConfigError
from services.gateway import config
from services.gateway.completions.generation import SamplingSpec, derive_seed
from services.gateway.tracing import grpc_trace_metadata


def test_the_default_model_constants_mirror_the_engine_loader() -> None:
    from engine.loader import prepare

    assert config.DEFAULT_MODEL_NAME == prepare.DEFAULT_MODEL_NAME
    assert config.PREPARED_MARKER == prepare.MARKER_FILE


def test_the_gateway_never_imports_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, services.gateway.app, services.gateway.__main__; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_an_unprepared_default_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="make model"):
        config.resolve_model_dir(None, tmp_path)


def test_derived_seeds_differ_per_choice_and_stay_in_the_engines_range() -> None:
    assert [derive_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert derive_seed(None, 2) is None
    assert SamplingSpec(4, seed=-1).to_proto().seed == 2**63 - 1


def test_grpc_metadata_carries_the_current_span_as_traceparent() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("request") as span:
        metadata = dict(grpc_trace_metadata())
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert metadata["traceparent"].split("-")[1] == trace_id
    assert grpc_trace_metadata() == ()  # outside any span: nothing to propagate
