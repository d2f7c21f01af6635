"""`baton bench` end to end against the deterministic SSE test server (known delays, known failures)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_sse_server import Behaviour, BenchSSEServer

from loadtest.cli import main
from loadtest.client import ClientConfig, OpenAIStreamClient
from loadtest.records import RequestRecord, TokenSource
from loadtest.report import load_result
from loadtest.tokens import PromptTokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(server: BenchSSEServer, out: Path, *extra: str, name: str = "run") -> dict:
    """Run the CLI against `server`; return the result document."""
    path = out / f"{name}.json"
    argv = ["--base-url", server.base_url, "--num-prompts", "6", "--random-input-len", "16",
            "--random-output-len", "8", "--request-rate", "inf", "--max-concurrency", "3", "--tokenizer", "words",
            "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--result-json", str(path), "--no-progress", *extra]
    assert main(argv) == 0
    return json.loads(path.read_text())


def summary(doc: dict, run: int = 0) -> dict:
    return doc["runs"][run]["summary"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_measured_ttft_itl_tpot_match_the_server_delays(sse_server: BenchSSEServer, tmp_path: Path,
                                                        endpoint: str) -> None:
    s = summary(bench(sse_server, tmp_path, "--endpoint", endpoint))  # server: TTFT 100 ms, then 20 ms/token
    assert s["completed"] == 6 and s["token_sources"] == {"usage": 6} and s["total_output_tokens"] == 48
    assert 100 <= s["ttft_ms"]["p50"] <= 140  # the chat role-only chunk at t=0 did not stop the clock
    assert s["itl_ms"]["p50"] == pytest.approx(20, abs=5)
    assert s["tpot_ms"]["mean"] == pytest.approx(20, abs=3)
    assert s["e2e_ms"]["p50"] == pytest.approx(100 + 7 * 20, abs=30)
    assert s["goodput_fraction"] == 1.0


@pytest.mark.parametrize("sse_server", [Behaviour(tokens_per_chunk=4)], indirect=True)
def test_multi_token_chunks_add_zero_itl_samples(sse_server: BenchSSEServer, tmp_path: Path) -> None:
    doc = bench(sse_server, tmp_path)
    r = doc["runs"][0]["requests"][0]
    assert (r["content_chunks"], r["output_tokens"]) == (2, 8)
    s = summary(doc)
    assert s["itl_ms"]["p50"] == 0.0  # 6 of each request's 7 ITL samples are zeros
    assert s["itl_ms"]["mean"] == pytest.approx(s["tpot_ms"]["mean"], rel=0.05)


@pytest.mark.parametrize("sse_server", [Behaviour(reject={1: 429, 3: 503})], indirect=True)
def test_429_and_503_are_errors_and_goodput_misses(sse_server: BenchSSEServer, tmp_path: Path) -> None:
    doc = bench(sse_server, tmp_path)
    s = summary(doc)
    assert s["errors"] == {"http_429": 1, "http_503": 1}
    assert (s["completed"], s["good_requests"], s["num_requests"]) == (4, 4, 6)
    assert s["goodput_fraction"] == pytest.approx(4 / 6)
    assert sorted(r["http_status"] for r in doc["runs"][0]["requests"]) == [200] * 4 + [429, 503]


@pytest.mark.parametrize("sse_server", [Behaviour(hang={0}, truncate={1})], indirect=True)
def test_timeouts_and_truncated_streams_are_counted_by_kind(sse_server: BenchSSEServer, tmp_path: Path) -> None:
    s = summary(bench(sse_server, tmp_path, "--request-timeout", "0.6"))
    assert s["errors"] == {"disconnect": 1, "timeout": 1}
    assert s["completed"] == 4 and s["goodput_fraction"] == pytest.approx(4 / 6)


def test_request_carries_api_key_model_and_usage_option(sse_server: BenchSSEServer, tmp_path: Path) -> None:
    doc = bench(sse_server, tmp_path, "--api-key", "sk-test-123")
    body = sse_server.requests[0]
    assert body["_authorization"] == "Bearer sk-test-123"
    assert body["model"] == "bench-test-model"  # from GET /v1/models
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert len(body["prompt"].split()) == 16 and body["max_tokens"] == 8
    assert "sk-test-123" not in json.dumps(doc) and doc["config"]["api_key_set"] is True


@pytest.mark.parametrize("sse_server", [Behaviour(send_usage=False)], indirect=True)
async def test_without_usage_the_count_source_is_stated(sse_server: BenchSSEServer,
                                                        engine_tokenizer: PromptTokenizer) -> None:
    async with OpenAIStreamClient(ClientConfig(sse_server.base_url), engine_tokenizer) as client:
        record = await client.send([{"role": "user", "content": "hi"}], RequestRecord("r", 0, 0, 0.0, 1, 5))
    assert record.ok and record.token_source is TokenSource.TOKENIZER
    assert record.output_tokens == engine_tokenizer.count(" tok0 tok1 tok2 tok3 tok4")
    async with OpenAIStreamClient(ClientConfig(sse_server.base_url)) as client:  # no tokenizer: chunks
        record = await client.send([{"role": "user", "content": "hi"}], RequestRecord("r", 0, 0, 0.0, 1, 5))
    assert (record.token_source, record.output_tokens) == (TokenSource.CHUNKS, 5)


@pytest.mark.parametrize("sse_server", [Behaviour(cached_fraction=0.5)], indirect=True)
def test_multiturn_reports_the_prefix_cache_hit_rate(sse_server: BenchSSEServer, tmp_path: Path) -> None:
    doc = bench(sse_server, tmp_path, "--dataset", "multiturn", "--num-prompts", "3", "--num-turns", "2",
                "--system-prompt-len", "20", "--random-input-len", "5", "--random-output-len", "3")
    s = summary(doc)
    assert s["num_requests"] == 6 and s["completed"] == 6
    assert s["prefix_cache"]["hit_rate"] == pytest.approx(0.5, abs=0.05)
    second_turns = [b["messages"] for b in sse_server.requests if len(b["messages"]) == 4]
    assert len(second_turns) == 3 and all(m[2]["content"] == " tok0 tok1 tok2" for m in second_turns)


def test_result_json_and_png_are_written_and_reload_to_the_same_summary(sse_server: BenchSSEServer,
                                                                         tmp_path: Path) -> None:
    doc = bench(sse_server, tmp_path, "--request-rate", "50", "inf", "--plot", str(tmp_path / "run.png"))
    assert doc["schema"] == "baton.bench/1" and [r["request_rate"] for r in doc["runs"]] == [50.0, "inf"]
    assert len(doc["runs"][0]["requests"]) == 6 and doc["config"]["tokenizer_kind"] == "words"
    assert (tmp_path / "run.png").read_bytes()[:8] == PNG_MAGIC
    reloaded = load_result(tmp_path / "run.json")
    assert math.isinf(reloaded.runs[1].request_rate)
    again = reloaded.summaries()[0]
    assert again["good_requests"] == summary(doc)["good_requests"]
    assert again["itl_ms"]["p50"] == pytest.approx(summary(doc)["itl_ms"]["p50"], abs=0.01)


def test_compare_prints_and_plots_runs_side_by_side(sse_server: BenchSSEServer, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    bench(sse_server, tmp_path, "--request-rate", "40", "inf", "--label", "alpha", name="a")
    bench(sse_server, tmp_path, "--request-rate", "20", "--label", "beta", name="b")
    capsys.readouterr()
    plot = tmp_path / "cmp.png"
    assert main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--plot", str(plot)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[1:] if line.split() and line.split()[0] in {"alpha", "beta"}]
    assert [(r[0], r[1]) for r in rows] == [("alpha", "40"), ("alpha", "inf"), ("beta", "20")]
    assert plot.read_bytes()[:8] == PNG_MAGIC


def test_unreachable_server_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--base-url", "http://127.0.0.1:9", "--tokenizer", "words", "--no-progress"]) == 2
    assert "pass --model" in capsys.readouterr().err
