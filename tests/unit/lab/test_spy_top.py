"""py-spy raw profiles summarised (lab/experiments/spy_top.py)."""

from lab.experiments.spy_top import function, main, tally

RAW = [
    "main (services/gateway/__main__.py:103);EventLog.events_after (services/gateway/streams/replay_log.py:119) 30",
    "main (services/gateway/__main__.py:103);Tokenizer.encode (tokenization/tokenizer.py:94);"
    "encode_batch (tokenizers/__init__.py:10) 20",
    "select (selectors.py:468) 50",
    "garbage line",
]


def test_a_library_call_is_charged_to_our_frame_that_made_it() -> None:
    total, own, inclusive = tally(RAW)
    assert total == 100
    assert own["Tokenizer.encode (tokenization/tokenizer.py)"] == 20
    assert own["EventLog.events_after (services/gateway/streams/replay_log.py)"] == 30
    assert own["select (selectors.py)"] == 50  # no frame of ours: the innermost one
    assert inclusive["main (services/gateway/__main__.py)"] == 50


def test_line_numbers_are_dropped_so_a_function_is_one_entry() -> None:
    assert function("f (a/b.py:3)") == function("f (a/b.py:9)") == "f (a/b.py)"
    assert function("<module>") == "<module>"


def test_the_command_prints_the_top_functions_of_each_file(tmp_path, capsys) -> None:
    profile = tmp_path / "gateway-1.txt"
    profile.write_text("\n".join(RAW) + "\n")
    empty = tmp_path / "scheduler-2.txt"
    empty.write_text("")
    assert main([str(profile), str(empty), "--top", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"== {profile}: 100 samples",
        "-- own", "     50  50.0%  select (selectors.py)",
        "-- inclusive", "     50  50.0%  main (services/gateway/__main__.py)",
        f"== {empty}: 0 samples"]
