"""Generate the Python stubs of protos/ into rpcgen/baton/ (`python -m rpcgen.codegen`).

protoc writes `from baton.v1 import worker_pb2`; we rewrite it to the package path so the stubs import
without touching sys.path. `tests/unit/rpc/test_codegen.py` regenerates into a temp dir and fails when
the committed stubs are stale.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos"
GEN_DIR = ROOT / "rpcgen"
PACKAGE = "rpcgen"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto and return the generated files under out_dir."""
    from grpc_tools import protoc  # build-time dependency (test extras)

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", *protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {protos}")
        written = []
        for src in sorted(Path(tmp).rglob("*.py*")):
            rel = src.relative_to(tmp)
            dst = out_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            text = re.sub(r"^from baton\.v1 import", f"from {PACKAGE}.baton.v1 import", src.read_text(),
                          flags=re.M)
            dst.write_text(text)
            written.append(dst)
    for pkg in {p.parent for p in written} | {out_dir, out_dir / "baton"}:
        (pkg / "__init__.py").touch()
    return written


if __name__ == "__main__":
    files = generate(GEN_DIR)
    print(f"generated {len(files)} files into {GEN_DIR}", file=sys.stderr)
