"""Every environment variable the library reads, in one place.

They are documented defaults only: each has an argument or a :class:`~engram.options.ServingOptions`
field that wins over it. Read where a default is needed (at construction, never per call):

``ENGRAM_WKV_BACKEND``  default of ``ServingOptions.wkv_backend`` / ``WkvProjection(backend=None)``
``ENGRAM_WKV_SMALL_M``  default of ``ServingOptions.wkv_small_m`` (``1`` / ``0``)
``LOCAL_WORLD_SIZE``    processes sharing the node (torchrun sets it): splits the host-gather threads
``ENGRAM_CACHE_DIR``    where token maps are cached (else ``$XDG_CACHE_HOME/engram``, ``~/.cache/engram``)
``TRITON_INTERPRET``    Triton's own switch (``1``: kernels run on the CPU interpreter)
``CC``                  the C compiler that builds the host gather's native worker at install time, and at
                        first use where the install built none (else ``cc`` / ``gcc``)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["WKV_BACKEND_ENV", "WKV_SMALL_M_ENV", "wkv_backend_default", "wkv_small_m_default",
           "local_world_size", "cache_directory", "triton_interpret", "c_compiler"]

WKV_BACKEND_ENV = "ENGRAM_WKV_BACKEND"
WKV_SMALL_M_ENV = "ENGRAM_WKV_SMALL_M"


def wkv_backend_default() -> tuple[str | None, str]:
    """``(value or None, the variable's name)`` of ``ENGRAM_WKV_BACKEND`` (checked by the caller, which
    names the variable in its error)."""
    given = os.environ.get(WKV_BACKEND_ENV, "")
    return (given or None), WKV_BACKEND_ENV


def wkv_small_m_default() -> bool | None:
    """``ENGRAM_WKV_SMALL_M`` as a bool, None when unset; ValueError naming the variable otherwise."""
    given = os.environ.get(WKV_SMALL_M_ENV, "")
    if given == "":
        return None
    if given not in ("0", "1"):
        raise ValueError(f"{WKV_SMALL_M_ENV}: expected '0' or '1', found {given!r}")
    return given == "1"


def local_world_size() -> int | None:
    """``LOCAL_WORLD_SIZE`` as a positive integer, None when unset or empty; ValueError naming the
    variable for anything else (a typo would silently split the host-gather threads wrongly)."""
    given = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if given == "":
        return None
    if not given.isdigit() or int(given) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE: expected a positive integer (the processes sharing this node, as "
                         f"torchrun sets it), found {given!r}")
    return int(given)


def cache_directory() -> Path:
    """Where the library caches what it derives (token maps)."""
    if os.environ.get("ENGRAM_CACHE_DIR"):
        return Path(os.environ["ENGRAM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "engram"


def triton_interpret() -> bool:
    """Whether ``TRITON_INTERPRET=1`` (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def compile_library(command_for, file_name: str, prefix: str, what: str):
    """Build a shared library at first use and load it: ``command_for(compiler, target)`` (an argv) into a
    private temporary directory (removed at once; the loaded library stays mapped). Returns ``(ctypes.CDLL
    or None, why not)``, the reason naming ``what`` was built."""
    import ctypes
    import subprocess
    import tempfile

    compiler = c_compiler()
    if compiler is None:
        return None, "no C compiler found ($CC, cc or gcc)"
    directory = tempfile.mkdtemp(prefix=prefix)  # mode 0700: this user's only
    try:
        target = os.path.join(directory, file_name)
        command = command_for(compiler, target)
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as error:
            return None, f"{compiler} could not run: {error}"
        if result.returncode != 0:
            return None, f"{' '.join(command)} failed: {result.stderr.strip()[-400:]}"
        try:
            return ctypes.CDLL(target), ""
        except OSError as error:
            return None, f"the compiled {what} did not load: {error}"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def c_compiler() -> str | None:
    """The C compiler to use: ``$CC`` when set and found, else ``cc`` or ``gcc`` on the ``PATH``, else None."""
    for name in (os.environ.get("CC", ""), "cc", "gcc"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None
