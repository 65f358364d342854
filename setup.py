"""The build's one step beyond pyproject.toml: the host gather's native worker, compiled at install time.

``native_gather.c`` becomes the package's ``engram/table/host_memory/_native_gather<EXT_SUFFIX>`` (an editable
install puts it into ``src/``), built by ``gather_protocol.build_command``, the command of the first-use build.
Without a C compiler, or where the build fails, the install goes on without it (the extension is optional:
setuptools warns), and ``native_worker`` compiles the worker at first use instead, saying so.
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


def worker_command(target) -> list[str]:
    """The command that builds the worker into ``target`` (CompileError without a C compiler)."""
    compiler = _module(PACKAGE / "environment.py").c_compiler()
    if compiler is None:
        raise CompileError("no C compiler found ($CC, cc or gcc)")
    return _module(PACKAGE / "table" / "host_memory" / "gather_protocol.py").build_command(compiler, target)


class BuildNativeWorker(build_ext):
    """build_ext for the worker, a plain shared library (no Python module): one compiler command."""

    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name))
        target.unlink(missing_ok=True)  # a failed build leaves no older library to ship
        target.parent.mkdir(parents=True, exist_ok=True)
        self.spawn(worker_command(target))


if __name__ == "__main__":
    setup(ext_modules=[Extension("engram.table.host_memory._native_gather",
                                 sources=["src/engram/table/host_memory/native_gather.c"], optional=True)],
          cmdclass={"build_ext": BuildNativeWorker})
