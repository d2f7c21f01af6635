"""Tensor and expert parallelism inside one worker: the group (`group`), the MoE experts' all-to-all
(`expert`) and the one-process-per-rank launcher (`launcher`).

`launcher` is imported on demand (it pulls in the model runner); `group` is what layers import.
"""

from engine.parallel.expert import ExpertParallel
from engine.parallel.group import (
    TensorParallel,
    check_tensor_parallel,
    init_tensor_parallel,
    local_kv_heads,
    open_rendezvous,
    shutdown_tensor_parallel,
)

__all__ = [
    "ExpertParallel",
    "TensorParallel",
    "check_tensor_parallel",
    "init_tensor_parallel",
    "local_kv_heads",
    "open_rendezvous",
    "shutdown_tensor_parallel",
]
