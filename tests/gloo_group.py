"""Ending a gloo process group in the tests' spawned ranks."""

from __future__ import annotations

import torch.distributed as dist


def end_group() -> None:
    """Meet every rank, then destroy the group. A rank that tore gloo down while another still talked to it
    aborted now and then (SIGABRT, "terminate called without an active exception") on a loaded 2-core CPU.
    A rank that never arrives fails the barrier after the group's timeout."""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
