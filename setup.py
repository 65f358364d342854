"""The build's one step beyond pyproject.toml: two small native libraries, compiled at install time.

``native_gather.c`` becomes the package's ``engram/table/host_memory/_native_gather<EXT_SUFFIX>`` (the host
gather's worker), built by ``gather_protocol.build_command``; ``disk_reads.c`` becomes
``engram/table/disk/_disk_reads<EXT_SUFFIX>`` (the disk tier's page reads), built by
``reads_build.build_command``; each the command of its first-use build (an editable install puts them into
``src/``). Without a C compiler, or where a build fails, the install goes on without it (the extensions are
optional: setuptools warns), and the package compiles the library at first use instead, saying so.
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

PACKAGE = Path(__file__).resolve().parent / "src" / "engram"


def _module(path: Path):
    """A module of the package loaded from its file: these two import no torch, which the package does."""
    spec = importlib.util.spec_from_file_location(f"_engram_build_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiler() -> str:
    compiler = _module(PACKAGE / "environment.py").c_compiler()
    if compiler is None:
        raise CompileError("no C compiler found ($CC, cc or gcc)")
    return compiler


def worker_command(target) -> list[str]:
    """The command that builds the worker into ``target`` (CompileError without a C compiler)."""
    return _module(PACKAGE / "table" / "host_memory" / "gather_protocol.py").build_command(_compiler(), target)


def disk_reads_command(target) -> list[str]:
    """The command that builds the disk reads' library into ``target`` (CompileError without a C compiler)."""
    return _module(PACKAGE / "table" / "disk" / "reads_build.py").build_command(_compiler(), target)


COMMANDS = {"engram.table.host_memory._native_gather": worker_command,
            "engram.table.disk._disk_reads": disk_reads_command}


class BuildNativeWorker(build_ext):
    """build_ext for the native libraries, plain shared libraries (no Python module): one compiler command each."""

    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name))
        target.unlink(missing_ok=True)  # a failed build leaves no older library to ship
        target.parent.mkdir(parents=True, exist_ok=True)
        self.spawn(COMMANDS[ext.name](target))


if __name__ == "__main__":
    setup(ext_modules=[Extension("engram.table.host_memory._native_gather",
                                 sources=["src/engram/table/host_memory/native_gather.c"], optional=True),
                       Extension("engram.table.disk._disk_reads", sources=["src/engram/table/disk/disk_reads.c"],
                                 optional=True)],
          cmdclass={"build_ext": BuildNativeWorker})
