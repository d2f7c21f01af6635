"""`--quantization` and `--kv-cache-dtype`: one definition for `baton generate/chat`, `baton worker` and
`baton serve` (which passes them on to its workers). Torch-free, so `baton serve` can import it."""

from __future__ import annotations

import argparse

QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # engine/config.py validates the same names


def add_quantization_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                   help="fp8: e4m3 weights for the attention and MLP projections, quantized per channel at "
                        "load (an FP8 checkpoint runs as stored without this flag)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="fp8_e4m3: one byte per KV value (twice the tokens per GiB, half the bytes per "
                        "prefill->decode hand-off); prefill and decode workers must agree")


def quantization_worker_args(quantization: str | None, kv_cache_dtype: str) -> list[str]:
    """The `baton worker` flags that reproduce these settings (none for the defaults)."""
    argv = ["--quantization", quantization] if quantization else []
    return argv + (["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype != "auto" else [])
