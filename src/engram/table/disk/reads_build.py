"""How the disk reads' library is built: the one command of the install-time build (``setup.py``, which
loads this file by its path: it imports nothing but the standard library) and of the first-use build
(:mod:`engram.table.disk.reads`).

``disk_reads.c`` becomes a small shared library of its own, ``_disk_reads<EXT_SUFFIX>`` beside this
module (not the host gather's ``_native_gather``: the two sources change independently, each library
reports its own source digest, and each is refused alone when stale).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["SOURCE", "LIBRARY_STEM", "source_digest", "build_command"]

SOURCE = Path(__file__).with_name("disk_reads.c")
LIBRARY_STEM = "_disk_reads"


def source_digest(source: str | Path = SOURCE) -> int:
    """60 bits of the SHA-256 of ``source``: what ``engram_disk_source_digest`` of a library built from it returns."""
    return int(hashlib.sha256(Path(source).read_bytes()).hexdigest()[:15], 16)


def build_command(compiler: str, target: str | Path) -> list[str]:
    """The command that compiles ``disk_reads.c`` into the shared library ``target`` with ``compiler``."""
    return [compiler, "-O2", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-Wall",
            f"-DENGRAM_DISK_SOURCE_DIGEST={source_digest()}", str(SOURCE), "-o", str(target)]
