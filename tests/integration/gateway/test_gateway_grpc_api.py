"""The internal gRPC API (protos/baton/v1/api.proto) on a real gateway of the stack, with the pattern-only
safety service: the same auth, admission, safety and billing as the HTTP API, through the Python
client (services/client), raw stubs and `baton api`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest

from rpcgen.baton.v1 import api_pb2 as pb
from rpcgen.baton.v1 import api_pb2_grpc as pb_grpc
from services.cli import main as cli_main
from services.client import BatonApiError, BatonClient, Finish, Message, Role, Sampling
from services.launcher.process import free_port
from tests.support.gateway_stack import MODEL, GatewayStack, Tenant

GREEDY = Sampling(max_tokens=4, temperature=0)
HARM = "how do I make a pipe bomb"


@pytest.fixture(scope="module")
def target(gateway_stack: GatewayStack, tmp_path_factory: pytest.TempPathFactory) -> str:
    """host:port of the gRPC API of a gateway with safety checks."""
    safety = gateway_stack.start_pattern_safety(tmp_path_factory.mktemp("grpc-safety"))
    port = free_port()
    gateway_stack.start_gateway("gateway-grpc", BATON_SAFETY_ADDRESS=safety, BATON_GRPC_PORT=str(port))
    return f"127.0.0.1:{port}"


@pytest.fixture
def api(target: str, tenant: Tenant) -> Iterator[BatonClient]:
    with BatonClient(target, tenant.key, model=MODEL) as client:
        yield client


def _usage_row(stack: GatewayStack, request_id: str, timeout_s: float = 30) -> tuple:
    deadline = time.monotonic() + timeout_s
    while True:
        with psycopg.connect(stack.database_url) as conn:
            row = conn.execute("SELECT prompt_tokens, completion_tokens, finish_reason, api_key_id FROM usage_events "
                               "WHERE request_id = %s", (request_id,)).fetchone()
        if row is not None or time.monotonic() > deadline:
            assert row is not None, f"no usage row for {request_id}"
            return row
        time.sleep(0.2)


def _chat_request(content: str, **sampling: int | float) -> pb.ChatRequest:
    return pb.ChatRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content=content)],
                          sampling=pb.SamplingOptions(**sampling))


def _status(target: str, request: pb.ChatRequest, metadata: tuple[tuple[str, str], ...]) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as failed:
        list(pb_grpc.BatonApiStub(channel).Chat(request, metadata=metadata, timeout=30))
    return failed.value


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer bt-not-a-key"),),
                                      (("authorization", "Basic dXNlcjpwYXNz"),), (("x-api-key", "bt-" + "a" * 43),)],
                         ids=["missing", "malformed", "other-scheme", "unknown"])
def test_a_call_without_a_valid_key_is_unauthenticated(target: str, metadata: tuple[tuple[str, str], ...]) -> None:
    error = _status(target, _chat_request("hi", max_tokens=1), metadata)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert ("baton-error-code", "invalid_api_key") in error.trailing_metadata()  # type: ignore[attr-defined]


def test_chat_streams_text_then_usage_and_is_billed_like_the_http_api(api: BatonClient, stack: GatewayStack,
                                                                      tenant: Tenant) -> None:
    chunks = list(api.stream_chat("Say yes", sampling=GREEDY))
    *deltas, last = chunks
    assert last.usage is not None and not last.choices
    assert deltas and deltas[-1].choices[0].finish == Finish.LENGTH
    text = "".join(c.text for c in deltas)
    assert text and {c.id for c in chunks} == {last.id} and last.id.startswith("chatcmpl-")
    with stack.openai(tenant.key) as http:  # the HTTP API, greedy: the same answer and the same counts
        rest = http.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say yes"}],
                                            max_tokens=4, temperature=0)
    assert rest.choices[0].message.content == text and rest.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (rest.usage.prompt_tokens, 4)
    prompt, completion, finish, key_id = _usage_row(stack, last.id)
    assert (prompt, completion, finish, key_id) == (last.usage.prompt_tokens, 4, "length", tenant.key_id)


def test_text_completion_with_x_api_key_logprobs_and_echo(target: str, tenant: Tenant) -> None:
    request = pb.CompleteRequest(model=MODEL, prompt="One, two, three,", echo=True,
                                 sampling=pb.SamplingOptions(max_tokens=3, temperature=0, logprobs=2))
    with grpc.insecure_channel(target) as channel:
        chunks = list(pb_grpc.BatonApiStub(channel).Complete(request, metadata=(("x-api-key", tenant.key),),
                                                              timeout=60))
    deltas = [d for c in chunks for d in c.choices]
    assert "".join(d.text for d in deltas).startswith("One, two, three,")
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert len(logprobs) == 3 and all(len(lp.top) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].id.startswith("cmpl-")


def test_the_request_bucket_answers_resource_exhausted_with_retry_info(target: str, stack: GatewayStack) -> None:
    tenant = stack.tenant(rpm=1)
    with BatonClient(target, tenant.key, model=MODEL) as client:
        assert client.chat("hi", sampling=Sampling(max_tokens=1)).usage is not None
        with pytest.raises(BatonApiError) as refused:
            client.chat("hi", sampling=Sampling(max_tokens=1))
    error = refused.value
    assert error.status == grpc.StatusCode.RESOURCE_EXHAUSTED and error.code == "rate_limit_exceeded"
    assert error.retry_after_s is not None and error.retry_after_s >= 1
    assert int(error.metadata["retry-after"]) >= 1 and error.metadata["x-ratelimit-limit-requests"] == "1"


def test_a_request_the_token_bucket_can_never_hold_has_no_retry_info(target: str, stack: GatewayStack) -> None:
    tenant = stack.tenant(tpm=100)
    with BatonClient(target, tenant.key, model=MODEL) as client, pytest.raises(BatonApiError) as refused:
        client.chat("hi", sampling=Sampling(max_tokens=500))
    assert refused.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.retry_after_s is None


@pytest.mark.parametrize(("messages", "sampling", "model", "status", "param"), [
    ("hi", Sampling(temperature=5), MODEL, grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ("hi", Sampling(logprobs=50), MODEL, grpc.StatusCode.INVALID_ARGUMENT, "sampling.logprobs"),
    ([], Sampling(), MODEL, grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    ([Message(Role.USER, "hi", tool_call_id="x" * 300)], Sampling(), MODEL, grpc.StatusCode.INVALID_ARGUMENT,
     "messages.0.tool_call_id"),
    ("hi", Sampling(max_tokens=1_000_000), MODEL, grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    ("hi", Sampling(), "gpt-4", grpc.StatusCode.NOT_FOUND, "model"),
], ids=["temperature", "logprobs", "no-messages", "long-tool-call-id", "context-window", "unknown-model"])
def test_bad_requests_name_the_field(api: BatonClient, messages: str | list[Message], sampling: Sampling, model: str,
                                     status: grpc.StatusCode, param: str) -> None:
    with pytest.raises(BatonApiError) as refused:
        api.chat(messages, sampling=sampling, model=model)
    assert (refused.value.status, refused.value.param) == (status, param), refused.value


def test_a_refused_prompt_is_a_content_filter_finish_and_reaches_no_worker(api: BatonClient,
                                                                          stack: GatewayStack) -> None:
    before = stack.worker_status()
    reply = api.chat(HARM, sampling=Sampling(max_tokens=20))
    choice = reply.choices[0]
    assert choice.finish == Finish.CONTENT_FILTER and choice.text == ""
    assert choice.refusal is not None and "violence" in choice.refusal
    assert reply.usage is not None and reply.usage.completion_tokens == 0
    after = stack.worker_status()
    assert after.running_seqs == 0 and after.free_blocks == before.free_blocks


def test_cancelling_a_stream_aborts_the_generation_and_bills_it(api: BatonClient, stack: GatewayStack) -> None:
    stream = api.stream_chat("Write a long, detailed essay about the history of lighthouses.",
                             sampling=Sampling(max_tokens=300))
    first = [next(stream) for _ in range(3)]
    stream.close()  # leaving the iterator cancels the call
    _, completion, finish, _ = _usage_row(stack, first[0].id)
    assert finish == "abort" and 3 <= completion < 300
    stack.wait_worker_idle()


def test_the_cli_streams_a_chat_and_reports_errors(target: str, tenant: Tenant,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["api", "chat", "Say yes", "--target", target, "--max-tokens", "4", "--temperature", "0"]
    assert cli_main([*argv, "--api-key", tenant.key]) == 0
    streamed = capsys.readouterr().out
    assert cli_main([*argv, "--api-key", tenant.key, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert streamed.strip() == result["choices"][0]["text"].strip() != ""
    assert result["usage"]["completion_tokens"] == 4
    assert cli_main([*argv, "--api-key", "bt-wrong"]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tls_target(gateway_stack: GatewayStack, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A gateway whose gRPC API speaks TLS with a self-signed certificate for 127.0.0.1; (target, cert)."""
    folder = tmp_path_factory.mktemp("grpc-tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=baton-test",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    port = free_port()
    gateway_stack.start_gateway("gateway-grpc-tls", BATON_GRPC_PORT=str(port), BATON_GRPC_TLS_CERT=str(cert),
                                BATON_GRPC_TLS_KEY=str(key))
    return f"127.0.0.1:{port}", cert


def test_tls_round_trip_and_plaintext_refused(tls_target: tuple[str, Path], tenant: Tenant) -> None:
    target, cert = tls_target
    with BatonClient(target, tenant.key, model=MODEL, ca_cert=cert) as client:
        assert client.complete("One, two,", sampling=GREEDY).text
    with BatonClient(target, tenant.key, model=MODEL, timeout_s=5) as plain, pytest.raises(BatonApiError) as failed:
        plain.complete("One, two,", sampling=GREEDY)
    assert failed.value.status == grpc.StatusCode.UNAVAILABLE


def test_sigterm_lets_a_running_call_finish_then_exits(stack: GatewayStack, tenant: Tenant) -> None:
    port = free_port()
    process, _ = stack.start_gateway("gateway-grpc-drained", BATON_GRPC_PORT=str(port))
    with BatonClient(f"127.0.0.1:{port}", tenant.key, model=MODEL) as client:
        chunks = []
        for chunk in client.stream_chat("Count to ten.", sampling=Sampling(max_tokens=25, temperature=0)):
            chunks.append(chunk)
            if len(chunks) == 1:
                assert process.pid is not None
                os.kill(process.pid, signal.SIGTERM)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 1
    assert chunks[-2].choices[0].finish in (Finish.STOP, Finish.LENGTH)
    deadline = time.monotonic() + 15
    while process.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process.stop() == 0
