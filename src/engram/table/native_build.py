"""Build and load ``native/row_gather.c`` (the host row gather) with the system C compiler.

The compiler is ``$CC`` (split like a shell word list), else ``cc``, else ``gcc``, run with
:data:`CFLAGS`. The library goes to the engram cache directory (``$ENGRAM_CACHE_DIR``,
``$XDG_CACHE_HOME/engram`` or ``~/.cache/engram``; a private temporary directory when that
is not writable), named by a hash of the source, the compiler command, the flags and the
machine type, so a changed source or compiler builds anew. It is written to a temporary
file and renamed into place: processes building at once each rename a complete file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SOURCE", "CFLAGS", "RowGatherLibrary", "compiler_command", "build_row_gather"]

SOURCE = Path(__file__).with_name("native") / "row_gather.c"
CFLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
_COMPILE_TIMEOUT_S = 120


@dataclass(frozen=True)
class RowGatherLibrary:
    """The loaded functions (ctypes, argument types set; see row_gather.c) and the file."""

    gather_rows: ctypes._CFuncPtr
    gather_blocks: ctypes._CFuncPtr
    wait_rows: ctypes._CFuncPtr
    path: Path


def compiler_command() -> list[str] | None:
    """``$CC`` split into words, else the path of ``cc`` or ``gcc``, else None."""
    given = os.environ.get("CC")
    if given:
        return shlex.split(given)
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _library_name(compiler: list[str], source: bytes) -> str:
    key = hashlib.sha256()
    for part in (source, " ".join(compiler).encode(), " ".join(CFLAGS).encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return f"row_gather-{key.hexdigest()[:16]}.so"


def _writable(target: Path) -> Path:
    """``target``, or the same name in a new private temporary directory when ``target``'s
    directory cannot be created or written."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if os.access(target.parent, os.W_OK):
            return target
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="engram-native-")) / target.name


def _compile(compiler: list[str], target: Path) -> None:
    """Build into a temporary file next to ``target``, then rename it into place (atomic).
    Raises ``OSError`` (directory, missing compiler), ``RuntimeError`` (compiler error) or
    ``subprocess.TimeoutExpired``."""
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=target.stem + "-", suffix=".so.tmp")
    os.close(handle)
    try:
        result = subprocess.run([*compiler, *CFLAGS, "-o", temporary, str(SOURCE)], capture_output=True, text=True,
                                timeout=_COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()[:5]
            raise RuntimeError(f"{' '.join(compiler)} exited with status {result.returncode}: " + " | ".join(detail))
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _bind(library: ctypes.CDLL, path: Path) -> RowGatherLibrary:
    i64, i32, pointer = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    gather_rows = library.engram_gather_rows
    gather_rows.restype = i64
    gather_rows.argtypes = [pointer, i64, i64, pointer, i32, pointer, i64, i64, i64, i32, i32]
    gather_blocks = library.engram_gather_blocks
    gather_blocks.restype = None
    gather_blocks.argtypes = [pointer, i64, i64, pointer, i32, pointer, pointer, i64, pointer, i64, i32, i32]
    wait_rows = library.engram_wait_rows
    wait_rows.restype = i32
    wait_rows.argtypes = [pointer, i64, i64]
    return RowGatherLibrary(gather_rows, gather_blocks, wait_rows, path)


def build_row_gather() -> tuple[RowGatherLibrary | None, str]:
    """``(library, "")``, built now or found in the cache, or ``(None, why not)``."""
    compiler = compiler_command()
    if compiler is None:
        return None, "no C compiler found ($CC unset, neither cc nor gcc on PATH)"
    from ..vocab import cache_dir  # the package's cache directory (token maps live there too)

    name = _library_name(compiler, SOURCE.read_bytes())
    try:
        target = cache_dir() / name
        if not target.exists():
            target = _writable(target)
            _compile(compiler, target)
        return _bind(ctypes.CDLL(str(target)), target), ""
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as error:
        return None, f"building {SOURCE.name} with {' '.join(compiler)} failed: {error}"
