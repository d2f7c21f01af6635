"""Which encoder runtime runs: `auto` picks torch only with a visible GPU; a device torch cannot use is
a configuration error. (Torch's embeddings against numpy's: test_encoder_runtime.py, and on a CUDA GPU
tests/gpu/test_safety_encoder_gpu.py.)"""

from __future__ import annotations

import importlib.util

import pytest

from services.safety import encoder as encoder_module
from services.safety.encoder import EncoderRuntime, SentenceEncoder, resolve_runtime
from services.safety.torch_layers import TorchDeviceUnavailableError, check_device, cuda_visible


def test_auto_is_onnx_without_a_visible_gpu() -> None:
    if cuda_visible():
        pytest.skip("this machine has a GPU: tests/gpu/test_safety_encoder_gpu.py covers auto there")
    assert resolve_runtime(EncoderRuntime.AUTO) is EncoderRuntime.ONNX
    assert SentenceEncoder(runtime=EncoderRuntime.AUTO, verify=False).runtime is EncoderRuntime.ONNX


def test_auto_is_onnx_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(encoder_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real_find_spec(name, *a))
    assert resolve_runtime(EncoderRuntime.AUTO) is EncoderRuntime.ONNX


@pytest.mark.parametrize("runtime", [EncoderRuntime.ONNX, EncoderRuntime.NUMPY, EncoderRuntime.TORCH])
def test_a_named_runtime_is_kept(runtime: EncoderRuntime) -> None:
    assert resolve_runtime(runtime) is runtime


def test_an_unusable_device_is_a_config_error() -> None:
    with pytest.raises(TorchDeviceUnavailableError, match="only cpu and cuda"):
        check_device("meta")
    with pytest.raises(TorchDeviceUnavailableError, match="not a torch device"):
        check_device("gpu0")
    if not cuda_visible():
        with pytest.raises(TorchDeviceUnavailableError, match="sees no CUDA GPU"):
            SentenceEncoder(runtime=EncoderRuntime.TORCH, device="cuda", verify=False)
