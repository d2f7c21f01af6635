"""`baton profile --quick` on the default model (CPU): a profile the scheduler loads, that fits what it measured."""

from __future__ import annotations

import contextlib
import io
import json
import statistics
from pathlib import Path

import pytest
import torch

from scheduler.adapters.profiles import ProfileBook
from scheduler.core.cost_model import WorkerProfile
from services.cli import main as baton

MODEL = "SmolLM2-135M-Instruct"
# Stated tolerance of the fit on this shared 2-core CPU, where a neighbour can slow any one point:
# the typical point within 25% of its fitted time, none off by more than a factor of two.
MEDIAN_TOLERANCE = 0.25
WORST_TOLERANCE = 1.0


@pytest.fixture(scope="module")
def profiled(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One quick profile run, shared by the tests below (~15 s). One torch thread: on a shared host a
    multi-threaded step waits at every barrier for its slowest, descheduled thread, which makes the
    timings far noisier than the step itself."""
    out_dir = tmp_path_factory.mktemp("profile")
    out, points = out_dir / "profile.json", out_dir / "points.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()  # --torch-threads sets it for the whole process: put it back after
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = baton(["profile", "--quick", "--device", "cpu", "--torch-threads", "1", "--model-name", MODEL,
                          "--out", str(out), "--measurements-out", str(points)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, stderr.getvalue()
    return {"out": out, "points": json.loads(points.read_text()), "stdout": stdout.getvalue()}


def _relative_errors(profile: WorkerProfile, points: dict) -> tuple[list[float], list[float]]:
    prefill = [profile.prefill_s(p["new_tokens"], p["cached_tokens"]) / p["measured_s"] - 1 for p in points["prefill"]]
    decode = [profile.decode_step_s(d["batch"], d["batch"] * d["context_per_seq"]) / d["measured_s"] - 1
              for d in points["decode"]]
    return prefill, decode


def test_the_scheduler_loads_the_written_profile_under_the_model_name(profiled):
    book = ProfileBook.load(profiled["out"])
    assert set(book.by_model) == {MODEL}
    assert book.for_model(MODEL) is not None


def test_per_token_prefill_and_per_sequence_decode_costs_are_positive(profiled):
    profile = ProfileBook.load(profiled["out"]).by_model[MODEL]
    assert profile.prefill_per_token_s > 0
    assert profile.decode_per_seq_s > 0


def test_transfer_terms_keep_the_defaults_when_not_measured(profiled):
    profile = ProfileBook.load(profiled["out"]).by_model[MODEL]
    assert (profile.transfer_fixed_s, profile.transfer_per_token_s) == (
        WorkerProfile().transfer_fixed_s, WorkerProfile().transfer_per_token_s)


def test_the_written_coefficients_predict_the_measured_steps_within_tolerance(profiled):
    profile = ProfileBook.load(profiled["out"]).by_model[MODEL]
    prefill, decode = _relative_errors(profile, profiled["points"])
    assert len(prefill) == 6 and len(decode) == 6  # the quick grid, every point inside the default pool
    for errors in (prefill, decode):
        assert statistics.median(abs(e) for e in errors) <= MEDIAN_TOLERANCE, errors
        assert max(abs(e) for e in errors) <= WORST_TOLERANCE, errors


def test_the_printed_table_shows_each_point_and_the_coefficients(profiled):
    stdout = profiled["stdout"]
    assert "measured_ms" in stdout and "fitted_ms" in stdout
    assert "prefill step =" in stdout and "decode step  =" in stdout
    assert f"baton scheduler --profile {profiled['out']}" in stdout


@pytest.mark.parametrize("flags, message", [
    (["--device", "tpu"], "unknown device 'tpu'; valid: cpu, cuda, cuda:N"),
    (["--device", "banana"], "unknown device 'banana'"),
    (["--repeats", "0"], "--repeats >= 1"),
    (["--transfer-fixed-s", "-1"], "--transfer-fixed-s must be >= 0"),
])
def test_bad_flags_fail_before_loading_the_model(flags, message, tmp_path, capsys):
    assert baton(["profile", "--quick", "--out", str(tmp_path / "p.json"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("out, message", [
    ("missing/p.json", "does not exist"),
    (".", "is a directory"),
    ("file/p.json", "is not a directory"),
])
def test_an_unwritable_out_path_is_refused_up_front(out, message, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert baton(["profile", "--quick", "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton profile: error:") and message in err


def test_a_mixture_of_experts_model_is_profiled(default_model_dir: Path, tmp_path: Path) -> None:
    """A tiny DeepSeek-V2 (latent attention, routed + shared experts): the profile is the MoE worker's own
    measured step times, so it prices what a step really runs (the routed experts), not every parameter."""
    from tests.support.tiny_moe import save_tiny_moe

    model = save_tiny_moe("deepseek-v2", tmp_path / "deepseek-v2", default_model_dir)
    out, stderr = tmp_path / "profile.json", io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            code = baton(["profile", "--quick", "--device", "cpu", "--torch-threads", "1", "--model", str(model),
                          "--model-name", "tiny-deepseek", "--out", str(out), "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, stderr.getvalue()
    profile = ProfileBook.load(out).by_model["tiny-deepseek"]
    # The tiny model's prefills may all sit on the floor (launch-bound), so only the predictions are checked.
    assert profile.prefill_s(256) >= profile.prefill_s(16) > 0 and profile.decode_step_s(8, 8 * 64) > 0
