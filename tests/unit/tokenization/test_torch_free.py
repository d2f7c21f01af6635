"""The ground floor is torch-free and engine-free: the gateway and the engine both stand on it.

Each check runs in a fresh interpreter where `import torch` raises (`sys.modules['torch'] = None`), so
a torch import anywhere below `tokenization` -- direct or through engine/ -- fails the test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_NO_TORCH = "import sys; sys.modules['torch'] = None; "


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _NO_TORCH + code, *args], cwd=ROOT, capture_output=True,
                          text=True, check=False)


def test_every_module_imports_without_torch_or_the_engine() -> None:
    code = ("import importlib, pkgutil, tokenization; "
            "names = [m.name for m in pkgutil.walk_packages(tokenization.__path__, 'tokenization.')]; "
            "[importlib.import_module(n) for n in names]; "
            "ours = {m.split('.')[0] for m in sys.modules} & {'engine', 'kvtransfer', 'scheduler', 'services'}; "
            "assert not ours, ours; print(len(names))")
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 5  # tokenizer, chat_template, gguf_vocab, block_hashes, detokenizer, errors


def test_a_chat_is_tokenized_and_hashed_without_torch(default_model_dir: Path) -> None:
    code = ("from tokenization.tokenizer import Tokenizer; from tokenization.block_hashes import block_hashes; "
            "tok = Tokenizer.from_dir(sys.argv[1]); "
            "ids = tok.encode_chat([{'role': 'user', 'content': 'Count to ten, please.'}]); "
            "print(len(ids), len(block_hashes(ids, 4)))")
    done = _run(code, str(default_model_dir))
    assert done.returncode == 0, done.stderr
    n_ids, n_hashes = map(int, done.stdout.split())
    assert n_ids > 4 and n_hashes == n_ids // 4
