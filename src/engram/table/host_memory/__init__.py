"""Host memory for tables the GPU reads: packed, pinned rows (:mod:`.rows`), private and node-shared
buffers (:mod:`.buffers`, with :mod:`.shm_files` and :mod:`.shm_admin` for the shared files), and
the host-side read path (:mod:`.gather`, copying rows with :mod:`.row_copy`)."""

from engram.table.host_memory.buffers import (HUGE_PAGE_BYTES, HostBuffer, SharedTableInfo, allocate_host_buffer,
                                              list_shared_tables, memory_report, remove_shared_buffer,
                                              remove_shared_table, shared_buffer_path)

__all__ = ["HUGE_PAGE_BYTES", "HostBuffer", "SharedTableInfo", "allocate_host_buffer", "list_shared_tables",
           "memory_report", "remove_shared_buffer", "remove_shared_table", "shared_buffer_path"]
