"""What the ``engram`` command writes, and how its failures end.

* :class:`CommandFailed`: the work ran and failed, or found a problem (exit 1, one line).
* :class:`OutputFile`: a file written under exactly the name given, atomically: a temporary
  file beside it is made at once, so a path that cannot be written (a missing or read-only
  directory, ``/proc``) is refused before the slow work; the result is written there and
  renamed over the name, so a full disk or a Ctrl-C leaves nothing under the name.
* :func:`writable_directory`: a directory the command will fill (``demo --checkpoint``),
  made and probed before the slow work.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["CommandFailed", "OutputFile", "writable_directory", "staged_directory", "os_error_text"]


class CommandFailed(Exception):
    """The work ran and failed or found a problem: the command prints the message on stderr
    and exits with :attr:`exit_code` (1)."""

    exit_code = 1


def os_error_text(error: OSError) -> str:
    """``strerror`` of an OS error, or its text when it has none (``File too large``)."""
    return error.strerror or str(error) or type(error).__name__


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class OutputFile:
    """``--out``'s file (see the module docstring). ``flag`` names the option in every error.

    Use as a context manager: ``with OutputFile("--out", path) as out: ...; out.write(writer)``,
    ``writer(temporary_path)`` writing the whole file; leaving the block without a successful
    :meth:`write` removes the temporary file."""

    def __init__(self, flag: str, given: str):
        self.flag, self.given = flag, given
        path = Path(given)
        if path.is_dir():
            raise ValueError(f"{flag}: {given!r} is a directory; expected the path of a file to write")
        parent = path.parent
        if not parent.exists():
            raise ValueError(f"{flag}: the directory {str(parent)!r} of {given!r} does not exist")
        if not parent.is_dir():
            raise ValueError(f"{flag}: {str(parent)!r} (the directory of {given!r}) is not a directory")
        try:
            descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
        except OSError as error:
            raise ValueError(f"{flag}: cannot write a file in the directory {str(parent)!r} of {given!r} "
                             f"({os_error_text(error)})") from None
        os.close(descriptor)
        self.path, self.temporary = path, Path(temporary)
        self.written = False

    def write(self, writer: Callable[[Path], None]) -> None:
        """``writer(temporary)``, then the temporary file renamed to the name given. An OS error (a
        full disk) removes the temporary file and becomes :class:`CommandFailed` naming the flag."""
        try:
            writer(self.temporary)
            os.chmod(self.temporary, 0o666 & ~_umask())
            os.replace(self.temporary, self.path)
        except OSError as error:
            self.discard()
            raise CommandFailed(f"{self.flag}: could not write {self.given!r} ({os_error_text(error)}); nothing "
                                f"was written under that name") from None
        except BaseException:
            self.discard()
            raise
        self.written = True

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.temporary.unlink()

    def __enter__(self) -> "OutputFile":
        return self

    def __exit__(self, *exc) -> None:
        if not self.written:
            self.discard()


def _remove_made(path: Path, top: Path | None) -> None:
    """Remove the empty directories from ``path`` up to ``top`` (those a mkdir just made)."""
    if top is None:
        return
    current = path
    while True:
        with contextlib.suppress(OSError):
            current.rmdir()
        if current == top or current.parent == current:
            return
        current = current.parent


def writable_directory(flag: str, given: str, keep: bool = True) -> tuple[Path, Path | None]:
    """``(path, made)``: the directory ``given``, made (with its parents) when missing and
    probed with a temporary file, so that one that cannot be written is one error naming ``flag``
    (a path under a file, ``/proc``, a read-only mount) before any slow work. ``made``: the highest
    directory made now, or None (:func:`staged_directory` removes what was made when the fill fails);
    ``keep=False``: only probe, removing what was made."""
    path = Path(given)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}: expected a directory (or a path where one is made), found a file at {given!r}")
    top = None
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        top = candidate
    try:
        path.mkdir(parents=True, exist_ok=True)
        descriptor, probe = tempfile.mkstemp(prefix=".engram-probe-", dir=path)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        _remove_made(path, top)
        raise ValueError(f"{flag}: cannot write into {given!r} ({os_error_text(error)})") from None
    if not keep:
        _remove_made(path, top)
    return path, top


@contextlib.contextmanager
def staged_directory(flag: str, directory: Path, made: Path | None = None, last: str | None = None
                     ) -> Iterator[Path]:
    """A temporary directory inside ``directory`` to fill; when the block ends normally its files
    are moved into ``directory`` (``last``, e.g. ``config.json``, moved last, so a reader that
    looks for it finds every other file already there). On an OS error (a full disk) or any other
    exit, the temporary directory is removed (and the empty directories up to ``made``, those
    :func:`writable_directory` made); an OS error becomes :class:`CommandFailed` naming ``flag``."""
    staging = Path(tempfile.mkdtemp(prefix=".engram-staging-", dir=directory))
    try:
        try:
            yield staging
            names = sorted(p.name for p in staging.iterdir())
            if last in names:
                names = [n for n in names if n != last] + [last]
            for name in names:
                os.replace(staging / name, directory / name)
        except OSError as error:
            raise CommandFailed(f"{flag}: could not write into {str(directory)!r} ({os_error_text(error)}); "
                                f"nothing was left there") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_made(directory, made)   # only empty ones: those of a fill that failed
