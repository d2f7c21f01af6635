"""The committed gRPC stubs must equal a fresh generation from protos/.

protoc runs in a subprocess: grpc_tools' bundled protobuf/abseil crash when loaded into a process that
already holds NIXL's native libraries (seen when the whole unit suite runs in one process).
"""

import subprocess
import sys
from pathlib import Path

from rpcgen.codegen import GEN_DIR

ROOT = Path(__file__).resolve().parents[3]


def test_generated_stubs_are_current(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; from rpcgen.codegen import generate; "
            "[print(p) for p in generate(Path(sys.argv[1]))]")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    fresh = [Path(p) for p in out]
    assert fresh, "no .proto files generated anything"
    stale = [str(p.relative_to(tmp_path)) for p in fresh
             if (GEN_DIR / p.relative_to(tmp_path)).read_text() != p.read_text()]
    assert not stale, f"stale stubs (run `python -m rpcgen.codegen`): {stale}"
