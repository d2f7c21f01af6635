"""`python -m services.profiler ...` = `baton profile ...`, without importing the rest of the CLI (the
gateway's database driver and the like), for hosts that carry only the engine's dependencies."""

from __future__ import annotations

import argparse
import logging
import sys

from services.profiler.main import register_profile_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.profiler")
    register_profile_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["profile", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
