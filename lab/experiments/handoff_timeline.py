"""Per-request timestamps of the KV hand-off, finer than the workers' phase histograms.

    git archive HEAD | tar -x -C /tmp/tl && ln -s $PWD/.venv /tmp/tl/.venv
    python -m lab.experiments.handoff_timeline mark /tmp/tl      # a scratch copy, never a checkout
    (cd /tmp/tl && .venv/bin/python -m lab.micro.bench_disagg_gpu --smoke --kv-stream off \\
        --log-dir /tmp/run/logs --out /tmp/run/out.json > /tmp/run/bench.log)
    python -m lab.experiments.handoff_timeline read /tmp/run/logs /tmp/run/bench.log [--skip 20]

or `TIMELINE=1 bash lab/suites/handoff_overhead.sh`, which does the same on a copy of the tree.

`mark` inserts one `time.monotonic_ns()` log line (logger `TL`, INFO) at each point of the path below into
the copy's source (the anchors are lines of today's code: a missing one stops it, naming the file), and
the benchmark client prints its own send / first-token instants. CLOCK_MONOTONIC is one clock for every
process of a machine, so the marks of the client and the three workers line up.
`read` groups the marks by request, keeps the requests the client saw to the end, and prints each mark's
median time after the client's send, per path (disagg: the decode worker served it; both: co-located).
A mark seen more than once per request (a step's `chunk`, `emit`) is numbered: `chunk2` is the second.

Marks (prefix: c client, d decode, p prefill, b both worker): gen_in (Generate in), ask (Prefill RPC
sent), reserved, expected (the link expects the WRITE), pf_in (Prefill RPC in), dest_in / place
(PrefillDestination in / taken), eng_add (engine thread takes the request), chunk (a step schedules a
chunk of it), emit (a step sampled its token), cks0 / cks1 (the held blocks' checksums), first_tok (the
prefill job has its first token), have_dest, posted (the link thread posts the WRITE), write_done,
notice (the decode link sees the DONE notice), commit_start / verified / committed (decode engine
thread), observe (the attempt is over on the event loop), prefilled (the flow has its streams), pump
(an output leaves the engine stream), yield (a response goes to gRPC).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

_MARK = "from engine._tl import mark; "
_TL_MODULE = '''"""Temporary hand-off timestamps (lab/experiments/handoff_timeline.py): never committed."""
import logging
import time

_log = logging.getLogger("TL")


def mark(tag: str, rid: str) -> None:
    _log.info("TL %s %s %d", tag, rid.split("@")[0], time.monotonic_ns())
'''


@dataclass(frozen=True)
class Insertion:
    path: str
    anchor: str  # an exact run of lines of the file
    text: str  # inserted after the anchor (before it when `before`)
    before: bool = False


INSERTIONS = (
    Insertion("services/worker/servicer.py", "        assert self._decode is not None\n        try:\n",
              f"            {_MARK}mark('gen_in', request.request_id)\n"),
    Insertion("services/worker/servicer.py",
              "                yield _response(event, event.request_id or job.request_id)\n",
              f"                {_MARK}mark('yield', request.request_id)\n"),
    Insertion("services/worker/servicer.py",
              "        log.debug(\"Prefill %s traceparent=%s\", request.request_id, _traceparent(context))\n",
              f"        {_MARK}mark('pf_in', request.request_id)\n"),
    Insertion("services/worker/servicer.py", "            why = self._prefill.place(",
              f"            {_MARK}mark('dest_in', request.request_id)\n", before=True),
    Insertion("services/worker/decode_service.py", "        reserved = time.perf_counter()\n",
              f"        {_MARK}mark('ask', erid)\n"),
    Insertion("services/worker/decode_service.py",
              "        self._metrics.handoff_phase(HandoffPhase.RESERVE, time.perf_counter() - reserved)\n",
              f"        {_MARK}mark('reserved', erid)\n"),
    Insertion("services/worker/decode_service.py", "        async for out in stream:\n",
              f"            {_MARK}mark('pump', rid)\n"),
    Insertion("services/worker/decode_service.py", "            streams, path, reason = await self._prefill(flow)\n",
              f"            {_MARK}mark('prefilled', flow.job.request_id)\n"),
    Insertion("services/worker/decode_service.py", "        self._observe_handoff(result, reserved)\n",
              f"        {_MARK}mark('observe', erid)\n", before=True),
    Insertion("services/worker/remote_prefill.py", "        sent_at = time.monotonic()\n",
              f"        {_MARK}mark('expected', order.request_id)\n"),
    Insertion("services/worker/kv_link.py",
              "            self._resolve_expect(Arrival(landed.request_id, TransferState.DONE, \"\", landed, now))\n",
              f"            {_MARK}mark('notice', landed.request_id)\n", before=True),
    Insertion("services/worker/kv_link.py", "            send = _Send(fut, time.monotonic())\n",
              f"            {_MARK}mark('posted', plan.request_id)\n"),
    Insertion("services/worker/kv_link.py",
              "        send = self._sends.pop((transfer.request_id, transfer.attempt), None)\n",
              f"        {_MARK}mark('write_done', transfer.request_id)\n"),
    Insertion("engine/async_engine.py", "        def commit() -> None:\n",
              f"            {_MARK}mark('commit_start', request_id)\n"),
    Insertion("engine/async_engine.py", "                problem = verify()\n",
              f"                {_MARK}mark('verified', request_id)\n"),
    Insertion("engine/async_engine.py",
              "                done.set_result(CommitOutcome(CommitStatus.REJECTED, problem)"
              " if problem else COMMITTED)\n",
              f"            {_MARK}mark('committed', request_id)\n"),
    Insertion("services/worker/prefill_service.py", "            first = await self._first_token(job)\n",
              f"            {_MARK}mark('first_tok', order.request_id)\n"),
    Insertion("services/worker/prefill_service.py", "        order = await self._destination(job)\n",
              f"        {_MARK}mark('have_dest', job.order.request_id)\n"),
    Insertion("services/worker/prefill_service.py", "    def place(self, destination: PrefillDestination) -> str:\n",
              f"        {_MARK}mark('place', destination.request_id)\n"),
    Insertion("engine/llm_engine.py", "                    on_prefilled: OnPrefilled | None = None) -> None:\n",
              f"        {_MARK}mark('eng_add', request_id)\n"),
    Insertion("engine/llm_engine.py",
              "    def _mark_started(self, plan: BatchPlan) -> None:\n        now = self._clock()\n"
              "        for chunk in plan.chunks:\n",
              f"            {_MARK}mark('chunk', chunk.request_id)\n"),
    Insertion("engine/llm_engine.py", "        for request_id, sampled in result.sampled.items():\n",
              f"            {_MARK}mark('emit', request_id)\n"),
    Insertion("engine/llm_engine.py", "        checksums = (tuple(head_slice_checksums(",
              f"        {_MARK}mark('cks0', seq.request_id)\n", before=True),
    Insertion("engine/llm_engine.py", "        now = self._clock()\n        held = HeldBlocks(",
              f"        {_MARK}mark('cks1', seq.request_id)\n", before=True),
    Insertion("lab/micro/disagg_workers.py", "    t0 = time.perf_counter()\n",
              "    print(f'TLC send {req.request_id} {time.monotonic_ns()}', flush=True)\n"),
    Insertion("lab/micro/disagg_workers.py", "                out[\"ttft_s\"] = time.perf_counter() - t0\n",
              "                print(f'TLC first {req.request_id} {time.monotonic_ns()}', flush=True)\n"),
)


def mark_tree(root: Path) -> None:
    """Insert every mark into the source under `root` (a scratch copy: refused if it is a git checkout)."""
    if (root / ".git").exists():
        raise SystemExit(f"{root} is a git checkout: mark a scratch copy (git archive) instead")
    for ins in INSERTIONS:
        path = root / ins.path
        text = path.read_text()
        at = text.find(ins.anchor)
        if at < 0:
            raise SystemExit(f"{ins.path}: anchor not found (the code moved): {ins.anchor.strip()[:70]!r}")
        cut = at if ins.before else at + len(ins.anchor)
        path.write_text(text[:cut] + ins.text + text[cut:])
    (root / "engine/_tl.py").write_text(_TL_MODULE)


_WORKER_LINE = re.compile(r" TL (\S+) (\S+) (\d+)")
_CLIENT_LINE = re.compile(r"^TLC (\S+) (\S+) (\d+)")
_WORKERS = {"both": "b", "decode": "d", "prefill": "p"}


def read_marks(log_dir: Path, client_log: Path) -> dict[str, dict[str, int]]:
    """{request id: {mark: ns}} from the workers' logs (`log_dir`/<role>-0.log) and the client's output."""
    marks: dict[str, dict[str, int]] = defaultdict(dict)
    for worker, prefix in _WORKERS.items():
        for line in (log_dir / f"{worker}-0.log").read_text().splitlines():
            if m := _WORKER_LINE.search(line):
                _add(marks[m[2]], f"{prefix}:{m[1]}", int(m[3]))
    for line in client_log.read_text().splitlines():
        if m := _CLIENT_LINE.match(line):
            marks[m[2]][f"c:{m[1]}"] = int(m[3])
    return marks


def _add(request: dict[str, int], key: str, ns: int) -> None:
    n, numbered = 1, key
    while numbered in request:
        n += 1
        numbered = f"{key}{n}"
    request[numbered] = ns


def medians(requests: list[dict[str, int]]) -> list[tuple[str, int, float]]:
    """(mark, count, median ms after the client's send) of the marks most requests have, in time order."""
    counts = Counter(k for r in requests for k in r)
    rows = [(k, n, statistics.median((r[k] - r["c:send"]) / 1e6 for r in requests if k in r))
            for k, n in counts.items() if n >= 0.8 * len(requests)]
    return sorted(rows, key=lambda row: row[2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("mark").add_argument("root", type=Path)
    read = sub.add_parser("read")
    read.add_argument("log_dir", type=Path, help="the benchmark's --log-dir")
    read.add_argument("client_log", type=Path, help="the benchmark's output")
    read.add_argument("--skip", type=int, default=20, help="the first requests of each path (warm-up, identity)")
    args = p.parse_args(argv)
    if args.cmd == "mark":
        mark_tree(args.root)
        return 0
    seen = [r for r in read_marks(args.log_dir, args.client_log).values() if "c:send" in r and "c:first" in r]
    for path, requests in (("both", [r for r in seen if "d:gen_in" not in r]),
                           ("disagg", [r for r in seen if "d:gen_in" in r])):
        kept = requests[args.skip:]
        print(f"== {path}: {len(kept)} requests")
        for key, n, ms in medians(kept):
            print(f"  {key:<18} n={n:<4} {ms:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
