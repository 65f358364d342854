"""Launching Triton kernels with little Python per call.

``kernel[grid](*args)`` binds and specializes every argument on each call before
it reaches the C launcher: with the ~45 arguments of the hash kernel that is
most of an eager call's host time (DESIGN §4: 36-37 us for a bare launch of a
comparable kernel on the H200 host). :class:`CompiledLaunch` does that work
once per compiled variant, keyed by what the caller knows decides the variant,
and then calls the compiled kernel's C launcher directly; :class:`BoundLaunch`
fixes the variant once for a prepared call, so a warm launch builds no key at all.
Both go through Triton's own runner while a launch hook (a profiler's) is
registered. H200, hash kernel bare: 30-54 us through ``kernel[grid]``, 14-18 us
through :class:`CompiledLaunch` (benchmarks/NOTES.md, "Host cost v3").
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Hashable

import torch

__all__ = ["BoundLaunch", "CompiledLaunch", "triton_available", "interpreting", "integer_widths", "int_variant",
           "tensor_variant", "VERIFY_VARIANTS"]

# Tests set this: every launch also asks Triton which variant it would pick and
# checks that it is the cached one (a wrong key would launch the wrong binary).
VERIFY_VARIANTS = False


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``, read at import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def jit_without_alignment(**options):
    """``triton.jit`` with every argument excluded from 16-byte-alignment specialization,
    so a launch's variant depends on the tensors' dtypes alone (no ``data_ptr()`` per
    tensor per call). For kernels whose loads are gathers, where alignment buys nothing.
    A Triton without the option compiles as plain ``triton.jit`` (and
    :class:`CompiledLaunch` keys must then include alignment: see ``ALIGNMENT_SPECIALIZED``)."""
    import triton

    def decorate(function):
        # Pointers and ints only: Triton 3.6 refuses constexpr parameters in the list.
        annotations = getattr(function, "__annotations__", {})
        names = [name for name in function.__code__.co_varnames[:function.__code__.co_argcount]
                 if "constexpr" not in str(annotations.get(name, ""))]
        try:
            return triton.jit(do_not_specialize_on_alignment=names, **options)(function)
        except TypeError:
            ALIGNMENT_SPECIALIZED.add(function.__name__)
            return triton.jit(**options)(function)

    return decorate


# Kernels decorated by jit_without_alignment on a Triton that still specializes alignment.
ALIGNMENT_SPECIALIZED: set[str] = set()


def integer_widths(*values: int) -> tuple[bool, ...]:
    """Per integer argument: whether Triton passes it as a 64-bit value (its signature
    types ints by range, even where it does not specialize on the value)."""
    return tuple(not -2**31 <= value < 2**31 for value in values)


def int_variant(value: int) -> tuple[bool, bool, bool]:
    """What Triton specializes a specialized int argument on: 64-bit, ``== 1``, ``% 16 == 0``."""
    return not -2**31 <= value < 2**31, value == 1, value % 16 == 0


def tensor_variant(tensor: torch.Tensor) -> tuple[Any, bool]:
    """What Triton specializes a tensor argument on: dtype and 16-byte alignment."""
    return tensor.dtype, tensor.data_ptr() % 16 == 0


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


def _has_direct_runner(compiled: Any) -> bool:
    """Whether ``compiled`` (a Triton ``CompiledKernel`` after its first launch) exposes the
    launcher that its ``compiled[grid]`` runner calls (Triton 3.3 and later)."""
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")) and callable(
        getattr(compiled, "run", None))


class CompiledLaunch:
    """``launch(grid, variant, args, num_warps)`` runs ``kernel`` over ``grid`` programs (an int,
    or ``(x, y)`` for a two-dimensional grid).

    ``args``: every parameter of the kernel, in order, constexprs included.
    ``variant``: a hashable key that determines which binary Triton would compile
    for ``args``: the constexpr values, each tensor's :func:`tensor_variant` (unless
    the caller owns it and knows it), :func:`int_variant` of the specialized ints,
    :func:`integer_widths` of the others, and ``num_warps``. The first launch of a variant goes through ``kernel[grid]`` and
    keeps the compiled kernel; later ones call its C launcher directly on the current
    stream (through Triton's ``compiled[grid]`` runner while a launch hook, e.g. a
    profiler's, is set).
    Under the interpreter, or with an older Triton, every launch goes through
    ``kernel[grid]``.
    """

    def __init__(self, kernel: Callable):
        self.kernel = kernel
        self.compiled: dict[Hashable, Any] = {}
        # The compiled kernel's C launcher with its function handle and metadata, per variant:
        # called straight, without the closure Triton's ``compiled[grid]`` builds per launch.
        self._direct: dict[Hashable, tuple] = {}
        self._current_stream = None
        self._runtime_knobs = None

    def __call__(self, grid: int | tuple[int, int], variant: Hashable, args: tuple, num_warps: int, device_index: int = 0,
                 num_stages: int | None = None) -> Any:
        """Launch; returns the compiled kernel (None under the interpreter)."""
        key = (variant, num_warps, num_stages, device_index)
        compiled = self.compiled.get(key)
        options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
        grid_x, grid_y = (grid, 1) if isinstance(grid, int) else grid
        if compiled is None:
            compiled = self.kernel[(grid_x, grid_y)](*args, **options)
            if compiled is not None and hasattr(compiled, "function") and not interpreting():
                self.compiled[key] = compiled
            return compiled
        if VERIFY_VARIANTS:
            chosen = self.kernel.warmup(*args, grid=(grid_x, grid_y), **options)
            if chosen is not compiled:
                raise AssertionError(f"{self.kernel.__name__}: variant key {variant!r} maps to another binary")
        if self._current_stream is None:
            from triton.runtime import driver

            self._current_stream = driver.active.get_current_stream
            self._runtime_knobs = _runtime_knobs()
        stream = self._current_stream(device_index)
        runtime = self._runtime_knobs
        direct = self._direct.get(key)
        if direct is None or runtime is None or not _no_launch_hooks(runtime):
            # Triton's own runner (it also builds the launch metadata that profiling hooks want).
            compiled[(grid_x, grid_y, 1)](*args, stream=stream)
            if direct is None and _has_direct_runner(compiled):
                self._direct[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return compiled
        run, function, packed_metadata = direct
        run(grid_x, grid_y, 1, stream, function, packed_metadata, None, None, None, *args)
        return compiled

    def bind(self, variant: Hashable, num_warps: int, device_index: int = 0,
             num_stages: int | None = None) -> "BoundLaunch":
        """The launches of one variant, for a caller that decided it once (a prepared call):
        see :class:`BoundLaunch`."""
        return BoundLaunch(self, variant, num_warps, device_index, num_stages)


class BoundLaunch:
    """``bound(grid, args)``: ``launch(grid, variant, args, num_warps, device_index, num_stages)`` of
    its :class:`CompiledLaunch` with the variant fixed when bound, so a warm launch builds and
    hashes no key: it reads the current stream and calls the compiled kernel's C launcher.

    The first launches (compiling), launches while a launch hook is set or while
    ``VERIFY_VARIANTS`` is on, and every launch under the interpreter go through
    :class:`CompiledLaunch` itself. ``args`` must have the structure the variant was made for
    (the caller keys its prepared calls by it).
    """

    __slots__ = ("_owner", "_variant", "_num_warps", "_device_index", "_num_stages", "_direct")

    def __init__(self, owner: CompiledLaunch, variant: Hashable, num_warps: int, device_index: int = 0,
                 num_stages: int | None = None):
        self._owner, self._variant, self._num_warps = owner, variant, num_warps
        self._device_index, self._num_stages = device_index, num_stages
        self._direct = None  # (run, function, packed_metadata, current_stream, runtime knobs) once warm

    def __call__(self, grid: int | tuple[int, int], args: tuple) -> None:
        direct = self._direct
        if direct is not None and not VERIFY_VARIANTS:
            run, function, packed_metadata, current_stream, runtime = direct
            if _no_launch_hooks(runtime):
                grid_x, grid_y = (grid, 1) if grid.__class__ is int else grid
                run(grid_x, grid_y, 1, current_stream(self._device_index), function, packed_metadata,
                    None, None, None, *args)
                return
        owner = self._owner
        owner(grid, self._variant, args, num_warps=self._num_warps, device_index=self._device_index,
              num_stages=self._num_stages)
        if direct is None and owner._runtime_knobs is not None:
            found = owner._direct.get((self._variant, self._num_warps, self._num_stages, self._device_index))
            if found is not None:
                self._direct = (*found, owner._current_stream, owner._runtime_knobs)
