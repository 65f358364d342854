"""torch.distributed plumbing shared by the parallel tests, benchmarks and engines.

The layer's own tensor/sequence-parallel data movement lives in
:mod:`engram.layer.module`; this module only starts one process's rank.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["NCCL_ENVIRONMENT", "init_rank"]

# NVLink multicast can take a shared host's GPUs out of service: keep it off everywhere.
NCCL_ENVIRONMENT = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def init_rank(rank: int, world_size: int, backend: str, init_file: str, *, cpu_threads: int,
              timeout: datetime.timedelta) -> tuple[torch.device, str]:
    """Join the process group as ``rank`` and return ``(device, table placement)``.

    ``backend="nccl"``: one GPU per rank (``cuda:rank``, placement ``"device"``), with
    :data:`NCCL_ENVIRONMENT` set first; ``"gloo"``: the CPU with ``cpu_threads`` threads
    (placement ``"cpu"``). Initialized through ``file://init_file``.
    """
    if backend == "nccl":
        os.environ.update(NCCL_ENVIRONMENT)
        torch.cuda.set_device(rank)
        device, placement, extra = torch.device("cuda", rank), "device", {"device_id": torch.device("cuda", rank)}
    elif backend == "gloo":
        torch.set_num_threads(cpu_threads)
        device, placement, extra = torch.device("cpu"), "cpu", {}
    else:
        raise ValueError(f"backend: expected 'nccl' or 'gloo', found {backend!r}")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timeout, **extra)
    return device, placement
