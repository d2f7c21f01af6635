"""Print pyproject.toml's runtime dependencies (one per line) without the named distributions.

The services image (gateway, scheduler, safety, billing) never imports torch, the load-test stack or
the embedded Kafka broker, so docker/services.Dockerfile installs this list and then the project
itself with --no-deps: `python3 requirements.py pyproject.toml torch matplotlib ...`.
"""

from __future__ import annotations

import re
import sys
import tomllib


def runtime_requirements(pyproject: str, without: set[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        deps: list[str] = tomllib.load(f)["project"]["dependencies"]
    drop = {name.lower().replace("_", "-") for name in without}
    return [d for d in deps if re.split(r"[\s<>=!~\[;]", d, maxsplit=1)[0].lower().replace("_", "-") not in drop]


if __name__ == "__main__":
    print("\n".join(runtime_requirements(sys.argv[1], set(sys.argv[2:]))))
