"""Launching Triton kernels with little Python per call.

``kernel[grid](*args)`` binds and specializes every argument on each call before
it reaches the C launcher: with the ~45 arguments of the hash kernel that is
most of an eager call's host time (docs/design.md §4: 36-37 us for a bare launch of a
comparable kernel on the H200 host). :class:`CompiledLaunch` does that work
once per compiled variant, keyed by the kernel's own specialization rules
(:mod:`engram.triton_variants`), and then calls the compiled kernel's C launcher
directly; :class:`BoundLaunch` fixes a call structure once for a prepared call, so
a warm launch reads only the pointers' alignment. Both go through Triton's own
runner while a launch hook (a profiler's) is registered, and through
``kernel[grid]`` on every launch where the C launcher's signature is not one they
know (one warning per process). H200, hash kernel bare: 30-54 us through
``kernel[grid]``, 14-18 us through :class:`CompiledLaunch` (benchmarks/NOTES.md,
"Host cost v3").
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from typing import Any, Callable, Hashable

from engram.triton_variants import PreparedVariant, VariantRule
from engram.environment import triton_interpret

__all__ = ["BoundLaunch", "CompiledLaunch", "triton_available", "interpreting", "jit_without_alignment",
           "launcher_signature_known", "VERIFY_VARIANTS"]

# Tests set this: every launch also asks Triton which variant it would pick and
# checks that it is the cached one (a wrong key would launch the wrong binary), and
# every prepared launch checks its arguments against the structure it was prepared for.
VERIFY_VARIANTS = False


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``, read at import)."""
    return triton_interpret()


def jit_without_alignment(**options):
    """``triton.jit`` with every argument excluded from 16-byte-alignment specialization,
    so a launch's variant depends on the tensors' dtypes alone (no ``data_ptr()`` per
    tensor per call). For kernels whose loads are gathers, where alignment buys nothing.
    A Triton without the option compiles as plain ``triton.jit`` (the variant keys then
    take alignment: they read the kernel's parameters)."""
    import triton

    def decorate(function):
        # Pointers and ints only: Triton 3.6 refuses constexpr parameters in the list.
        annotations = getattr(function, "__annotations__", {})
        names = [name for name in function.__code__.co_varnames[:function.__code__.co_argcount]
                 if "constexpr" not in str(annotations.get(name, ""))]
        try:
            return triton.jit(do_not_specialize_on_alignment=names, **options)(function)
        except TypeError:
            return triton.jit(**options)(function)

    return decorate


def _runtime_knobs() -> Any:
    """Triton's runtime settings (where launch hooks are registered), None before Triton 3.4."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return getattr(knobs, "runtime", None)


def _no_launch_hooks(runtime: Any) -> bool:
    """Whether no launch hook is set. Triton 3.5+ keeps each hook as a ``HookChain`` (never None;
    empty when no hook is registered), earlier ones as None or a callable; a test may also assign
    a plain callable."""
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def _current_stream_getter() -> Callable[[int], Any]:
    """Triton's ``get_current_stream(device_index)`` of the active driver (a CUDA device's)."""
    from triton.runtime import driver

    return driver.active.get_current_stream


def _has_direct_runner(compiled: Any) -> bool:
    """Whether ``compiled`` (a Triton ``CompiledKernel`` after its first launch) exposes the
    launcher that its ``compiled[grid]`` runner calls (Triton 3.3 and later)."""
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")) and callable(
        getattr(compiled, "run", None))


# The direct path calls ``run(grid_x, grid_y, grid_z, stream, function, packed_metadata,
# launch_metadata, enter_hook, exit_hook, *args)``, as Triton's own ``compiled[grid]`` runner does.
# The parameter names before ``*args`` of the launchers known to take that call:
KNOWN_LAUNCHER_PARAMETERS = (
    # Triton 3.6 (CudaLauncher): metadata and hooks pass through *args to the C launch.
    ("gridX", "gridY", "gridZ", "stream", "function"),
    # Triton 3.9 (CudaLauncher).
    ("gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata", "launch_enter_hook",
     "launch_exit_hook"),
)
_LAUNCHER_VERDICTS: dict[type, bool] = {}  # per launcher class: its signature is a known one
_LAUNCHER_WARNED: list[bool] = []          # the fallback warning, once per process


def launcher_signature_known(run: Callable) -> bool:
    """Whether ``run`` (a compiled kernel's C launcher) has one of the signatures the direct path
    knows: positional parameters named as in :data:`KNOWN_LAUNCHER_PARAMETERS`, then ``*args``."""
    try:
        parameters = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError):  # not introspectable (a builtin, a partial over one)
        return False
    if not parameters or parameters[-1].kind is not inspect.Parameter.VAR_POSITIONAL:
        return False
    head = parameters[:-1]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind not in positional or p.default is not inspect.Parameter.empty for p in head):
        return False
    return tuple(p.name for p in head) in KNOWN_LAUNCHER_PARAMETERS


def _launches_directly(compiled: Any) -> bool:
    """Whether warm launches of ``compiled`` may call its C launcher directly: it has one, and its
    class's signature is known (checked once per class). Otherwise they go through ``kernel[grid]``,
    and the first such finding in the process warns."""
    if compiled is None or not _has_direct_runner(compiled):
        return False
    run = compiled.run
    verdict = _LAUNCHER_VERDICTS.get(type(run))
    if verdict is None:
        verdict = _LAUNCHER_VERDICTS[type(run)] = launcher_signature_known(run)
        if not verdict and not _LAUNCHER_WARNED:
            _LAUNCHER_WARNED.append(True)
            try:
                found = str(inspect.signature(run))
            except (TypeError, ValueError):
                found = "(not introspectable)"
            warnings.warn(f"engram: this Triton's kernel launcher {type(run).__qualname__}{found} is not one the "
                          f"direct launch path knows; every launch goes through kernel[grid] instead (correct, "
                          f"with more host time per launch)", RuntimeWarning, stacklevel=4)
    return verdict


class CompiledLaunch:
    """``launch(grid, args, num_warps)`` runs ``kernel`` over ``grid`` programs (an int,
    or ``(x, y)`` for a two-dimensional grid).

    ``args``: every parameter of the kernel, in order, constexprs included. The variant key is
    built from them by the kernel's :class:`~engram.triton_variants.VariantRule` (``self.rule``),
    with ``num_warps``, ``num_stages`` and the device. The first launch of a variant goes through
    ``kernel[grid]`` and keeps the compiled kernel; later ones call its C launcher directly on the
    current stream (through Triton's ``compiled[grid]`` runner while a launch hook, e.g. a
    profiler's, is set). Under the interpreter, or where the C launcher's signature is not a known
    one, every launch goes through ``kernel[grid]``.
    """

    def __init__(self, kernel: Callable):
        self.kernel = kernel
        self.rule = VariantRule(kernel)
        self.compiled: dict[Hashable, Any] = {}
        # The compiled kernel's C launcher with its function handle and metadata, per variant:
        # called straight, without the closure Triton's ``compiled[grid]`` builds per launch.
        self._direct: dict[Hashable, tuple] = {}
        self._current_stream = None
        self._runtime_knobs = None

    def __call__(self, grid: int | tuple[int, int], args: tuple, num_warps: int, device_index: int = 0,
                 num_stages: int | None = None) -> Any:
        """Launch; returns the compiled kernel (None under the interpreter)."""
        return self._launch(grid, self.rule.key(args), args, num_warps, device_index, num_stages)

    def _launch(self, grid, variant: Hashable, args: tuple, num_warps: int, device_index: int,
                num_stages: int | None) -> Any:
        key = (variant, num_warps, num_stages, device_index)
        compiled = self.compiled.get(key)
        options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
        grid_x, grid_y = (grid, 1) if isinstance(grid, int) else grid
        if compiled is None:
            compiled = self.kernel[(grid_x, grid_y)](*args, **options)
            if not interpreting() and _launches_directly(compiled):
                if self._current_stream is None:
                    self._current_stream = _current_stream_getter()
                    self._runtime_knobs = _runtime_knobs()
                self.compiled[key] = compiled
                self._direct[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return compiled
        if VERIFY_VARIANTS:
            chosen = self.kernel.warmup(*args, grid=(grid_x, grid_y), **options)
            if chosen is not compiled:
                raise AssertionError(f"{self.kernel.__name__}: variant key {variant!r} maps to another binary")
        stream = self._current_stream(device_index)
        runtime = self._runtime_knobs
        if runtime is None or not _no_launch_hooks(runtime):
            # Triton's own runner (it also builds the launch metadata that profiling hooks want).
            compiled[(grid_x, grid_y, 1)](*args, stream=stream)
            return compiled
        run, function, packed_metadata = self._direct[key]
        run(grid_x, grid_y, 1, stream, function, packed_metadata, None, None, None, *args)
        return compiled

    def bind(self, num_warps: int, device_index: int = 0, num_stages: int | None = None) -> "BoundLaunch":
        """The launches of one call structure, for a caller that planned it once (a prepared
        call): see :class:`BoundLaunch`."""
        return BoundLaunch(self, num_warps, device_index, num_stages)


class BoundLaunch:
    """``bound(grid, args)``: ``launch(grid, args, num_warps, device_index, num_stages)`` of its
    :class:`CompiledLaunch`, for calls whose ``args`` all have one structure (the caller keys
    its prepared calls by it): the first call prepares the variant from its arguments
    (:meth:`~engram.triton_variants.VariantRule.prepare`), and each call then reads only the
    alignment of the pointers whose alignment the kernel specializes. A warm launch of a seen
    alignment reads the current stream and calls the compiled kernel's C launcher.

    The first launch of each alignment (compiling), launches while a launch hook is set or while
    ``VERIFY_VARIANTS`` is on (which also checks ``args`` against the prepared structure), and
    every launch under the interpreter go through :class:`CompiledLaunch` itself.
    """

    __slots__ = ("_owner", "_num_warps", "_device_index", "_num_stages", "_prepared", "_direct")

    def __init__(self, owner: CompiledLaunch, num_warps: int, device_index: int = 0, num_stages: int | None = None):
        self._owner, self._num_warps = owner, num_warps
        self._device_index, self._num_stages = device_index, num_stages
        self._prepared: PreparedVariant | None = None
        # Per alignment bits: (run, function, packed_metadata, current_stream, runtime knobs) once warm.
        self._direct: dict[int, tuple] = {}

    @property
    def prepared(self) -> PreparedVariant | None:
        """The variant of this launch's call structure (None before the first call)."""
        return self._prepared

    def __call__(self, grid: int | tuple[int, int], args: tuple) -> None:
        prepared = self._prepared
        if prepared is None:
            prepared = self._prepared = self._owner.rule.prepare(args)
        bits = prepared.alignment(args) if prepared.positions else 0
        direct = self._direct.get(bits)
        if direct is not None and not VERIFY_VARIANTS:
            run, function, packed_metadata, current_stream, runtime = direct
            if _no_launch_hooks(runtime):
                grid_x, grid_y = (grid, 1) if grid.__class__ is int else grid
                run(grid_x, grid_y, 1, current_stream(self._device_index), function, packed_metadata,
                    None, None, None, *args)
                return
        if VERIFY_VARIANTS:
            prepared.check(args, bits)
        owner = self._owner
        owner._launch(grid, (prepared, bits), args, self._num_warps, self._device_index, self._num_stages)
        if direct is None and owner._runtime_knobs is not None:
            found = owner._direct.get(((prepared, bits), self._num_warps, self._num_stages, self._device_index))
            if found is not None:
                self._direct[bits] = (*found, owner._current_stream, owner._runtime_knobs)
