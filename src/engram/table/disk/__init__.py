"""The disk tier's foundation: row files of packed rows in 4 KiB pages (:mod:`.row_file`), written
resumably from a checkpoint (:mod:`.writing`), read by id with O_DIRECT page reads (:mod:`.reads`,
the C functions of ``disk_reads.c``)."""

from engram.table.disk.reads import RowReader, RowReadError, read_rows
from engram.table.disk.row_file import RowFile, RowFileHeader, RowFileLayout, open_row_file, row_file_fingerprint
from engram.table.disk.writing import ensure_row_file, layer_table_source, row_file_path, write_row_file

__all__ = ["RowFile", "RowFileHeader", "RowFileLayout", "open_row_file", "row_file_fingerprint", "RowReader",
           "RowReadError", "read_rows", "ensure_row_file", "write_row_file", "row_file_path", "layer_table_source"]
