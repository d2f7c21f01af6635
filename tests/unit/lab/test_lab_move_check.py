"""scripts/lab_move_check: after merging a branch written before the lab moved, the files it added at
loadtest/experiments and loadtest/micro (and their tests) move to lab/, and the old paths are rewritten."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "lab_move_check"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def _repo_with_a_stray_branch(tmp_path: Path) -> Path:
    files = {
        "loadtest/micro/bench_new.py": "from loadtest.micro.bench_decode import decode_bytes\n",
        "loadtest/micro/new_suite.sh": "bash loadtest/micro/new_suite.sh\n",
        # where git's directory-rename detection puts a suite another branch added to loadtest/micro
        "lab/micro/renamed_suite.sh": "bash lab/micro/renamed_suite.sh\n",
        "loadtest/experiments/new_fit.py": "import loadtest.experiments.serving_cost\n",
        "tests/unit/loadtest/test_bench_new.py": "from loadtest.micro.bench_new import decode_bytes\n",
        "tests/unit/loadtest/test_bench_arrivals.py": "from loadtest.arrivals import poisson\n",
        "docs/benchmarks.md": "run `python -m loadtest.micro.bench_new` or loadtest/micro/new_suite.sh\n",
        "services/gateway/app.py": ("from services.gateway.routing import RouterClient\n"
                                    "import services.gateway.generation\n"
                                    "from services.gateway.streams import redis_relay\n"
                                    "from services.gateway.routing.router_client import RoutingDecision\n"),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "services/gateway/routing").mkdir(parents=True)
    (tmp_path / "services/gateway/routing/router_client.py").write_text("")
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "lab_move_check")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    return tmp_path


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(repo / "scripts" / "lab_move_check"), *args], capture_output=True,
                          text=True, check=False)


def test_the_check_lists_what_is_left_and_fails(tmp_path: Path) -> None:
    repo = _repo_with_a_stray_branch(tmp_path)
    done = _run(repo)
    assert done.returncode == 1
    listed = set(done.stdout.splitlines()[1:])
    assert listed == {"loadtest/micro/bench_new.py", "loadtest/micro/new_suite.sh", "loadtest/experiments/new_fit.py",
                      "lab/micro/renamed_suite.sh",
                      "tests/unit/loadtest/test_bench_new.py", "docs/benchmarks.md", "services/gateway/app.py"}


def test_fix_moves_the_files_and_rewrites_the_old_paths(tmp_path: Path) -> None:
    repo = _repo_with_a_stray_branch(tmp_path)
    done = _run(repo, "--fix")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (repo / "lab/micro/bench_new.py").read_text() == "from lab.micro.bench_decode import decode_bytes\n"
    assert (repo / "lab/suites/new_suite.sh").read_text() == "bash lab/suites/new_suite.sh\n"
    assert (repo / "lab/suites/renamed_suite.sh").read_text() == "bash lab/suites/renamed_suite.sh\n"
    assert (repo / "lab/experiments/new_fit.py").read_text() == "import lab.experiments.serving_cost\n"
    assert (repo / "tests/unit/lab/test_bench_new.py").read_text() == "from lab.micro.bench_new import decode_bytes\n"
    assert (repo / "docs/benchmarks.md").read_text() == (
        "run `python -m lab.micro.bench_new` or lab/suites/new_suite.sh\n")
    assert (repo / "services/gateway/app.py").read_text() == (
        "from services.gateway.routing.router_client import RouterClient\n"
        "import services.gateway.completions.generation\n"
        "from services.gateway.streams import redis_relay\n"  # already the new path: left alone
        "from services.gateway.routing.router_client import RoutingDecision\n")
    assert (repo / "tests/unit/loadtest/test_bench_arrivals.py").exists()  # the harness's own tests stay
    assert not [p for p in (repo / "loadtest").rglob("*") if p.is_file()]
