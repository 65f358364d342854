"""A host gather captured in a CUDA graph (:meth:`HostGather.start_replayed
<engram.table.host_memory.gather.HostGather.start_replayed>`): buffers of its own, fixed for the graph's life,
and a replayed job of the native worker (gather_protocol, "Replayed jobs"), so every replay gathers that
replay's ids with nothing from the caller's thread. The protocol: docs/design.md, "Replayed gathers"."""

from __future__ import annotations

import torch

from engram.table.host_memory import stream_memory_ops
from engram.table.host_memory.gather import (_MAX_WAVES_NATIVE, GatherTicket, HostGather, _num_waves,
                                             shrinking_wave_ends)
from engram.table.host_memory.gather_protocol import FLAG_WORDS, IDS_READY, POSTED, WAVES_DONE
from engram.table.host_memory.rows import row_tags
from engram.table.graph_buffers import kept_for_graph
from engram.table.kernels.dedup import DistinctRows, distinct_rows, rows_in_lookup_order

__all__ = ["start_replayed"]


def start_replayed(gather: HostGather, global_ids: torch.Tensor, row_start: int, stream: torch.cuda.Stream,
                   bound_s: float) -> GatherTicket:
    """:meth:`HostGather.start_replayed <engram.table.host_memory.gather.HostGather.start_replayed>` (which
    documents it) for ``gather``: all of it on ``gather.replay_stream``, forked from ``stream`` (capturing)."""
    num_ids = global_ids.numel()
    if num_ids == 0:
        raise ValueError("global_ids: the host gather needs at least one id, found an empty tensor")
    if not torch.cuda.is_current_stream_capturing():
        raise RuntimeError("start_replayed: expected a CUDA-graph capture under way (use start outside one)")
    if not gather.replays:
        raise RuntimeError(f"start_replayed: needs the native worker, found the {gather.worker!r} worker")
    with gather._lock:
        if gather._broken is not None:
            raise RuntimeError(f"this table's host gather is unusable after an earlier failure: {gather._broken}")
        with stream_memory_ops.relaxed_capture(), torch.inference_mode(False):  # pinned, outside the graph
            ids_host = torch.zeros(num_ids + 1, dtype=torch.int32, pin_memory=True)
            staging_host = torch.empty(num_ids, gather.row_bytes, dtype=torch.uint8, pin_memory=True)
            flags = torch.zeros(FLAG_WORDS, dtype=torch.int32, pin_memory=True)
        row_tags(staging_host).fill_(-1)  # on the host: never served until a worker writes it
        flags_device = stream_memory_ops.device_address(flags, gather.device)
        num_waves = _num_waves(num_ids, _MAX_WAVES_NATIVE)
        wave_ends = shrinking_wave_ends(num_ids, num_waves)
        buffers = gather.native_service.prepare(table=gather.packed, staging=staging_host, flags=flags)
        gather.native_service.add_replayed(buffers, ids=ids_host, ready=flags[IDS_READY:], num_waves=num_waves,
                                           wave_ends=wave_ends, bound_s=bound_s)
        # Forked onto the copy stream at once: the row list, the ids' copy and the POSTED word stay off the
        # caller's stream (the decoder layers before the first Engram layer run beside them); the lookup
        # joins at finish(). Decode T = 256 on the H200: +0.48% -> +0.29% of a step over HBM tables.
        copies = gather.replay_stream
        copies.wait_stream(stream)
        global_ids.record_stream(copies)
        # kept for the graph's replays, outside its memory pool; every replay copies the whole staging in, so
        # its unwritten content is never read
        rows_and_count = kept_for_graph((num_ids + 1,), torch.int32, gather.device)
        inverse = kept_for_graph((num_ids,), torch.int32, gather.device)
        staging_device = kept_for_graph((num_ids, gather.row_bytes), torch.uint8, gather.device)
        with torch.cuda.stream(copies), torch.inference_mode(False):
            if gather.dedup == "always":
                distinct_rows(global_ids, row_start, gather.packed.shape[0] - 1,
                              out=DistinctRows(rows_and_count, inverse))
            else:
                rows_in_lookup_order(global_ids, row_start, gather.packed.shape[0] - 1, out=rows_and_count)
                torch.arange(num_ids, dtype=torch.int32, device=gather.device, out=inverse)
        with torch.cuda.device(gather.device):
            stream_memory_ops.copy_to_host(copies, ids_host.data_ptr(), rows_and_count.data_ptr(),
                                           4 * (num_ids + 1))
            stream_memory_ops.write_value(copies, flags_device + 4 * IDS_READY, POSTED)
            waves_done = flags_device + 4 * WAVES_DONE
            host_address, device_address = staging_host.data_ptr(), staging_device.data_ptr()
            for wave, (begin, end) in enumerate(zip([0, *wave_ends[:-1]], wave_ends)):
                stream_memory_ops.wait_value(copies, waves_done, wave + 1)
                offset = begin * gather.row_bytes
                stream_memory_ops.copy_to_device(copies, device_address + offset, host_address + offset,
                                                 (end - begin) * gather.row_bytes)
            stream_memory_ops.write_value(copies, waves_done, 0)
            done = torch.cuda.Event()
            done.record(copies)
        ticket = GatherTicket(0, None, inverse.view(global_ids.shape), done, staging=staging_device,
                              keep=(rows_and_count, staging_host, ids_host, flags))
        gather.replayed.append(ticket)
        return ticket
