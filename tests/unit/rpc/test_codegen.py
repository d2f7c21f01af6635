"""The committed gRPC stubs must equal a fresh generation from protos/."""

from pathlib import Path

from services.rpc.codegen import GEN_DIR, generate


def test_generated_stubs_are_current(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "no .proto files generated anything"
    stale = [str(p.relative_to(tmp_path)) for p in fresh
             if (GEN_DIR / p.relative_to(tmp_path)).read_text() != p.read_text()]
    assert not stale, f"stale stubs (run `python -m services.rpc.codegen`): {stale}"
