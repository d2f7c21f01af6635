"""The gRPC API's edges without a server: metadata keys, requests -> the HTTP API's bodies (and their
errors in proto names), the formatters' chunks -> messages -> client types, typed errors -> statuses."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from rpcgen.baton.v1 import api_pb2 as pb
from services.client.types import Chunk, Completion, Finish, retry_delay
from services.common.errors import (
    AuthenticationError,
    BudgetExceededError,
    ConfigError,
    DependencyUnavailableError,
    RateLimitError,
)
from services.gateway.completions.formatting import ChatFormatter, ResponseMeta, TextFormatter, TokenTexts
from services.gateway.completions.generation import TokenLogprob
from services.gateway.completions.run_state import ChoiceEvent
from services.gateway.errors import BadRequestError, FeatureDisabledError, ModelNotFoundError, UpstreamError
from services.gateway.grpc_api.chunks import chunk_from_body
from services.gateway.grpc_api.requests import chat_body, text_body
from services.gateway.grpc_api.server import GrpcApiConfig
from services.gateway.grpc_api.servicer import presented_key
from services.gateway.grpc_api.status import DETAILS_KEY, failure_of, stream_failure
from tokenization.tokenizer import Tokenizer

KEY = "bt-" + "k" * 43


@pytest.mark.parametrize(("metadata", "key"), [
    ((("authorization", f"Bearer {KEY}"),), KEY), ((("x-api-key", f" {KEY} "),), KEY),
    ((("x-api-key", KEY), ("authorization", "Bearer other")), KEY), ((("user-agent", "x"),), None), (None, None),
])
def test_the_key_comes_from_x_api_key_or_a_bearer_header(metadata: tuple | None, key: str | None) -> None:
    assert presented_key(metadata) == key


def test_a_non_bearer_authorization_is_refused() -> None:
    with pytest.raises(AuthenticationError):
        presented_key((("authorization", "Basic abc"),))


def test_a_chat_request_becomes_the_http_apis_streaming_body() -> None:
    body = chat_body(pb.ChatRequest(
        model="m", user="u", messages=[pb.ChatMessage(role="system", content="Be brief"),
                                       pb.ChatMessage(role="tool", content="42", tool_call_id="call_1")],
        sampling=pb.SamplingOptions(max_tokens=5, temperature=0, seed=-3, stop=["\n"], n=2, logprobs=3)))
    assert (body.model, body.user, body.stream, body.include_usage) == ("m", "u", True, True)
    assert (body.max_tokens, body.temperature, body.top_p, body.seed) == (5, 0.0, None, -3)
    assert (body.stop, body.n) == (["\n"], 2)
    assert (body.logprobs, body.top_logprobs) == (True, 3)
    assert body.messages[1].tool_call_id == "call_1" and body.messages[0].name is None


def test_unset_sampling_takes_the_http_apis_defaults() -> None:
    body = text_body(pb.CompleteRequest(model="m", prompt="p"))
    assert (body.max_tokens, body.temperature, body.n, body.logprobs, body.echo) == (None, None, 1, None, False)


@pytest.mark.parametrize(("sampling", "param"), [
    (pb.SamplingOptions(temperature=3), "sampling.temperature"), (pb.SamplingOptions(top_p=0), "sampling.top_p"),
    (pb.SamplingOptions(stop=["a"] * 5), "sampling.stop"), (pb.SamplingOptions(logprobs=21), "sampling.logprobs"),
    (pb.SamplingOptions(n=17), "sampling.n"),
])
def test_bad_fields_are_named_as_the_proto_spells_them(sampling: pb.SamplingOptions, param: str) -> None:
    with pytest.raises(BadRequestError) as refused:
        chat_body(pb.ChatRequest(model="m", messages=[pb.ChatMessage(role="user", content="x")], sampling=sampling))
    assert refused.value.param == param and str(refused.value).startswith(param)


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(BadRequestError) as refused:
        chat_body(pb.ChatRequest(model="m", messages=[pb.ChatMessage(role="wizard", content="x")]))
    assert refused.value.param == "messages.0.role"


@pytest.fixture(scope="module")
def texts(default_model_dir: Path) -> TokenTexts:
    return TokenTexts(Tokenizer.from_dir(default_model_dir))


def test_chat_chunks_become_messages_and_join_into_a_completion(texts: TokenTexts) -> None:
    formatter = ChatFormatter(ResponseMeta("chatcmpl-1", 7, "m", 1, include_usage=True), texts)
    logprob = TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.5)))
    bodies = [formatter.chunk(ChoiceEvent(0, "Hi", (5,), (logprob,))),
              formatter.chunk(ChoiceEvent(0, " there", (), (), "length"))]
    chunks = [Chunk.from_proto(chunk_from_body(b)) for b in bodies]
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 1}}
    chunks.append(Chunk.from_proto(chunk_from_body({**bodies[0], "choices": [], "usage": usage})))
    result = Completion.collect(chunks)
    assert (result.id, result.text, result.finish) == ("chatcmpl-1", "Hi there", Finish.LENGTH)
    (lp,) = result.choices[0].logprobs
    assert (lp.token, lp.logprob, lp.raw) == (texts.get(5)[0], -0.5, bytes(texts.get(5)[1]))
    assert [p for _, p in lp.top] == [-0.5, -1.5]
    assert result.usage is not None and (result.usage.total_tokens, result.usage.cached_tokens) == (5, 1)


def test_a_refusal_chunk_keeps_its_reason(texts: TokenTexts) -> None:
    formatter = ChatFormatter(ResponseMeta("chatcmpl-2", 7, "m", 1), texts)
    body = formatter.chunk(ChoiceEvent(0, "", (), (), "content_filter", "refused (violence)"))
    choice = Chunk.from_proto(chunk_from_body(body)).choices[0]
    assert (choice.finish, choice.refusal, choice.text) == (Finish.CONTENT_FILTER, "refused (violence)", "")


def test_text_chunks_carry_echo_and_logprobs(texts: TokenTexts) -> None:
    formatter = TextFormatter(ResponseMeta("cmpl-1", 7, "m", 1, echo_prompts=("Say: ",)), texts)
    body = formatter.chunk(ChoiceEvent(0, "ok", (5,), (TokenLogprob(5, -0.25, ((5, -0.25),)),), "stop"))
    choice = chunk_from_body(body).choices[0]
    assert (choice.text, choice.finish, choice.logprobs[0].logprob) == ("Say: ok", pb.COMPLETION_FINISH_STOP, -0.25)
    assert [t.logprob for t in choice.logprobs[0].top] == [-0.25]


def _metadata(failure_metadata: tuple) -> dict:
    return dict(failure_metadata)


def test_a_rate_limit_is_resource_exhausted_with_retry_info_and_the_limit_headers() -> None:
    failure = failure_of(RateLimitError("slow down", "key_rpm", 2.2, {"x-ratelimit-limit-requests": "4"}))
    metadata = _metadata(failure.metadata)
    assert failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and failure.message == "slow down"
    assert metadata["baton-error-code"] == "rate_limit_exceeded" and metadata["retry-after"] == "3"
    assert metadata["x-ratelimit-limit-requests"] == "4" and retry_delay(metadata[DETAILS_KEY]) == 3.0


@pytest.mark.parametrize(("error", "code", "retry"), [
    (RateLimitError("never fits", "key_tpm", None), grpc.StatusCode.RESOURCE_EXHAUSTED, False),
    (BudgetExceededError("spent"), grpc.StatusCode.RESOURCE_EXHAUSTED, False),
    (AuthenticationError("invalid API key"), grpc.StatusCode.UNAUTHENTICATED, False),
    (ModelNotFoundError("x", ["m"]), grpc.StatusCode.NOT_FOUND, False),
    (DependencyUnavailableError("redis down"), grpc.StatusCode.UNAVAILABLE, True),
    (UpstreamError("worker gone"), grpc.StatusCode.UNAVAILABLE, False),
    (FeatureDisabledError("conversations", "none"), grpc.StatusCode.UNIMPLEMENTED, False),
    (RuntimeError("bug"), grpc.StatusCode.INTERNAL, False),
])
def test_typed_errors_map_to_statuses(error: Exception, code: grpc.StatusCode, retry: bool) -> None:
    failure = failure_of(error)
    assert failure.code == code and (DETAILS_KEY in _metadata(failure.metadata)) == retry
    if code == grpc.StatusCode.INTERNAL:
        assert failure.message == "internal server error"  # nothing of the bug leaks


def test_a_bad_field_is_named_in_the_metadata() -> None:
    metadata = _metadata(failure_of(ModelNotFoundError("x", ["m"])).metadata)
    assert (metadata["baton-error-code"], metadata["baton-error-param"]) == ("model_not_found", "model")


def test_a_failure_mid_stream_is_unavailable_with_its_code() -> None:
    failure = stream_failure({"message": "the worker failed", "type": "server_error", "code": "upstream_error"})
    assert failure.code == grpc.StatusCode.UNAVAILABLE
    assert _metadata(failure.metadata)["baton-error-code"] == "upstream_error"


def test_tls_needs_both_files_and_reads_them_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="both or neither"):
        GrpcApiConfig.from_paths("127.0.0.1", 0, str(tmp_path / "cert.pem"), None)
    with pytest.raises(ConfigError, match="BATON_GRPC_TLS_KEY"):
        GrpcApiConfig.from_paths("127.0.0.1", 0, str(tmp_path / "cert.pem"), str(tmp_path / "missing.pem"))
    assert GrpcApiConfig.from_paths("127.0.0.1", 0, None, None).credentials() is None
