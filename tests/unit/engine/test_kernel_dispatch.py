"""`BATON_FUSED_KERNELS` and the device decide whether the decoder's elementwise ops take the fused kernels."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.kernels import dispatch


@pytest.fixture(autouse=True)
def _fresh_switch() -> Iterator[None]:
    dispatch.fused_kernels_enabled.cache_clear()
    yield
    dispatch.fused_kernels_enabled.cache_clear()


def test_cpu_tensors_always_take_the_torch_reference() -> None:
    assert not dispatch.use_fused_kernels(torch.zeros(2))


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("1", True), ("0", False)])
def test_the_environment_switch(monkeypatch: pytest.MonkeyPatch, value: str | None, enabled: bool) -> None:
    if value is None:
        monkeypatch.delenv(dispatch.FUSED_KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(dispatch.FUSED_KERNELS_ENV, value)
    assert dispatch.fused_kernels_enabled() is enabled  # triton is installed wherever the tests run
