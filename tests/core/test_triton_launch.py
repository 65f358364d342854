"""engram.triton_launch: the alignment-free jit, the direct launch path and its fallback (CPU
checks with a stand-in kernel; the GPU tests run every CompiledLaunch with VERIFY_VARIANTS on,
tests/conftest.py). The variant keys themselves: tests/core/test_triton_variants.py."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_hash_kernels_leave_constexprs_out_of_the_alignment_list():
    """Triton 3.6 refuses a constexpr parameter listed in do_not_specialize_on_alignment
    (3.9 accepts it): the H200 run of 14a319b failed every hash launch that way."""
    from engram.hashing import kernels

    for kernel in (kernels.ngram_hash_kernel, kernels.slot_write_kernel, kernels.history_write_kernel):
        params = kernel.params
        assert not [p.name for p in params if p.is_constexpr and p.do_not_specialize_on_alignment], kernel
        pointers = [p for p in params if p.name.endswith("_ptr")]
        assert pointers and all(p.do_not_specialize_on_alignment for p in pointers), kernel


class _RunnerCalls:
    """Counts launches through Triton's own ``compiled[grid]`` runner (the path CompiledLaunch
    takes while compiling or while a launch hook is set)."""

    def __init__(self, monkeypatch):
        from triton.compiler.compiler import CompiledKernel

        self.count = 0
        original = CompiledKernel.__getitem__

        def counted(kernel, grid):
            self.count += 1
            return original(kernel, grid)

        monkeypatch.setattr(CompiledKernel, "__getitem__", counted)


def _set_enter_hook(knobs, hook):
    """Register ``hook`` as Triton does (a HookChain's ``add`` on 3.5+, assignment before);
    returns the undo."""
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        return lambda: chain.remove(hook)
    knobs.runtime.launch_enter_hook = hook
    return lambda: setattr(knobs.runtime, "launch_enter_hook", chain)


def _add_two_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_two(pointer, count, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < count
        tl.store(pointer + offsets, tl.load(pointer + offsets, mask=inside) + 2, mask=inside)

    return add_two


@pytest.mark.gpu
@pytest.mark.parametrize("bound", [False, True], ids=["compiled", "bound"])
def test_warm_launches_run_direct_and_through_triton_while_a_hook_is_set(bound, monkeypatch):
    """Warm launches (of a CompiledLaunch, or of a BoundLaunch: a variant fixed once, as prepared
    calls use) call the compiled kernel's C launcher straight; with a launch hook set (a
    profiler's) they go through Triton's runner, so the hook sees every launch. Every launch,
    the compiling one included, adds the same."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from triton import knobs

    from engram.triton_launch import CompiledLaunch

    values = torch.zeros(999, device="cuda", dtype=torch.int32)
    compiled = CompiledLaunch(_add_two_kernel())
    if bound:
        bound_launch = compiled.bind(num_warps=4)
        launch = lambda grid: bound_launch(grid, (values, 999, 128))  # noqa: E731
    else:
        launch = lambda grid: compiled(grid, (values, 999, 128), num_warps=4)  # noqa: E731
    for _ in range(3):  # compile (keeps the C launcher), then direct launches
        launch(8)
    assert compiled._direct and (not bound or bound_launch._direct), "no direct runner kept"
    runner = _RunnerCalls(monkeypatch)
    seen = []
    undo = _set_enter_hook(knobs, lambda metadata: seen.append(metadata))
    try:
        launch(8)
    finally:
        undo()
    launch((8, 1))
    assert len(seen) == 1
    assert runner.count == 1, "a warm launch without hooks went through Triton's runner"
    torch.testing.assert_close(values.cpu(), torch.full((999,), 10, dtype=torch.int32), rtol=0, atol=0)


@pytest.mark.interpreter
def test_bound_launch_goes_through_its_compiled_launch_when_interpreted():
    """Under the interpreter nothing compiles: every bound launch runs ``kernel[grid]``."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs with TRITON_INTERPRET=1 (scripts/dev.sh test)")
    import torch

    from engram.triton_launch import CompiledLaunch

    values = torch.zeros(37, dtype=torch.int32)
    bound = CompiledLaunch(_add_two_kernel()).bind(num_warps=1)
    for _ in range(3):
        bound(3, (values, 37, 16))
    assert not bound._direct
    assert torch.equal(values, torch.full((37,), 6, dtype=torch.int32))


def test_launch_hooks_are_seen_in_every_form_triton_keeps_them():
    """Triton 3.5+ keeps launch hooks in HookChains (never None); earlier ones use None or a
    callable. Direct launches run only while no hook is registered in either form."""
    from types import SimpleNamespace

    from engram.triton_launch import _no_launch_hooks

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert _no_launch_hooks(SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    assert _no_launch_hooks(SimpleNamespace(launch_enter_hook=Chain([]), launch_exit_hook=Chain([])))
    assert not _no_launch_hooks(SimpleNamespace(launch_enter_hook=Chain([print]), launch_exit_hook=Chain([])))
    assert not _no_launch_hooks(SimpleNamespace(launch_enter_hook=None, launch_exit_hook=print))
    try:
        from triton import knobs
    except ImportError:
        return
    runtime = getattr(knobs, "runtime", None)
    if runtime is not None:  # this Triton's own default: no hook registered
        assert _no_launch_hooks(runtime)


# ---- the direct path on the CPU: a stand-in kernel whose launches run in torch ---------------
def _launcher_36(kernel):
    def run(gridX, gridY, gridZ, stream, function, *args):  # Triton 3.6: metadata and hooks in *args
        kernel.direct_launch(function, args[4:])
    return run


def _launcher_39(kernel):
    def run(gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
            launch_exit_hook, *args):
        kernel.direct_launch(function, args)
    return run


def _launcher_changed(kernel):
    def run(gridX, gridY, gridZ, stream, function, kernel_metadata, *args):  # a signature no Triton here has
        raise AssertionError("a launcher of unknown signature was called directly")
    return run


class _Binary:
    """A stand-in compiled kernel: its C launcher, handle and metadata, and the pointer alignment
    it was compiled for."""

    def __init__(self, run, aligned: bool):
        self.run, self.aligned = run, aligned
        self.function, self.packed_metadata = self, object()


class _StandInKernel:
    """``add_two``'s parameters and specialization rules, with launches that add 2 in torch:
    ``kernel[grid](*args)`` returns one binary per variant (as Triton does, by the real rules),
    and a binary's direct launch checks that the pointer has the alignment it was compiled for."""

    def __init__(self, make_launcher):
        from engram.triton_variants import VariantRule

        real = _add_two_kernel()
        self.params, self.fn, self.__name__ = real.params, real.fn, "add_two"
        self._rule, self._make_launcher = VariantRule(real), make_launcher
        self.binaries: dict = {}
        self.triton_launches = self.direct_launches = 0

    def __getitem__(self, grid):
        def launch(pointer, count, block, **options):
            self.triton_launches += 1
            pointer[:count] += 2
            key = self._rule.key((pointer, count, block))
            if key not in self.binaries:
                self.binaries[key] = _Binary(self._make_launcher(self), pointer.data_ptr() % 16 == 0)
            return self.binaries[key]
        return launch

    def direct_launch(self, binary, args):
        pointer, count, _ = args
        assert binary.aligned == (pointer.data_ptr() % 16 == 0), "a binary ran with a pointer of another alignment"
        self.direct_launches += 1
        pointer[:count] += 2


@pytest.fixture
def direct_path(monkeypatch):
    """The direct path as on a GPU (no interpreter, no variant verification), with a stand-in
    stream, and the launcher checks and the warning fresh for the test."""
    from engram import triton_launch

    monkeypatch.setattr(triton_launch, "interpreting", lambda: False)
    monkeypatch.setattr(triton_launch, "VERIFY_VARIANTS", False)
    monkeypatch.setattr(triton_launch, "_current_stream_getter", lambda: (lambda device_index: 0))
    monkeypatch.setattr(triton_launch, "_LAUNCHER_VERDICTS", {})
    monkeypatch.setattr(triton_launch, "_LAUNCHER_WARNED", [])
    return triton_launch


@pytest.mark.parametrize("make_launcher", [_launcher_36, _launcher_39], ids=["triton-3.6", "triton-3.9"])
def test_known_launchers_are_called_directly(direct_path, make_launcher, recwarn):
    import torch

    kernel = _StandInKernel(make_launcher)
    launch = direct_path.CompiledLaunch(kernel)
    bound = launch.bind(num_warps=4)
    values = torch.zeros(40, dtype=torch.int32)
    for _ in range(3):
        launch(2, (values, 40, 16), num_warps=4)
        bound(2, (values, 40, 16))
    assert (kernel.triton_launches, kernel.direct_launches) == (2, 4)  # one compile each, then direct
    assert torch.equal(values, torch.full((40,), 12, dtype=torch.int32))
    assert not [w for w in recwarn if "launcher" in str(w.message)]


def test_an_unknown_launcher_signature_falls_back_to_triton_with_one_warning(direct_path):
    """A C launcher whose signature is not a known one is never called directly: every launch, of
    every CompiledLaunch and BoundLaunch, goes through ``kernel[grid]``; one warning per process."""
    import warnings

    import torch

    kernel = _StandInKernel(_launcher_changed)
    values = torch.zeros(40, dtype=torch.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = direct_path.CompiledLaunch(kernel), direct_path.CompiledLaunch(kernel)
        bound = second.bind(num_warps=1)
        for _ in range(3):
            first(2, (values, 40, 16), num_warps=4)
            bound(2, (values, 40, 16))
    fallback = [w for w in caught if "launcher" in str(w.message)]
    assert len(fallback) == 1 and issubclass(fallback[0].category, RuntimeWarning), [str(w.message) for w in caught]
    assert "kernel[grid]" in str(fallback[0].message)
    assert (kernel.triton_launches, kernel.direct_launches) == (6, 0)
    assert not first.compiled and not second.compiled
    assert torch.equal(values, torch.full((40,), 12, dtype=torch.int32))


def test_a_misaligned_pointer_never_reaches_a_binary_compiled_for_aligned_ones(direct_path):
    """After warm launches on an aligned tensor, a misaligned view of the same structure gets its own
    variant (compiled through ``kernel[grid]``), both for a CompiledLaunch and a BoundLaunch."""
    import torch

    kernel = _StandInKernel(_launcher_39)
    launch = direct_path.CompiledLaunch(kernel)
    bound = launch.bind(num_warps=4)
    storage = torch.zeros(41, dtype=torch.int32)
    aligned, misaligned = storage[:40], storage[1:41]
    for target in (launch, bound):
        run = ((lambda view: target(1, (view, 40, 64), num_warps=4)) if target is launch
               else (lambda view: target(1, (view, 40, 64))))
        run(aligned)
        run(aligned)
        run(misaligned)
        run(misaligned)
    assert len(kernel.binaries) == 2
    assert (kernel.triton_launches, kernel.direct_launches) == (4, 4)
    expected = torch.zeros(41, dtype=torch.int32)
    expected[:40] += 8
    expected[1:41] += 8
    assert torch.equal(storage, expected)


def test_the_installed_triton_launcher_has_a_known_signature():
    """The installed Triton's CUDA launcher takes the direct path's call (imported without a GPU)."""
    from engram.triton_launch import launcher_signature_known

    driver = pytest.importorskip("triton.backends.nvidia.driver")
    assert launcher_signature_known(object.__new__(driver.CudaLauncher))
    assert not launcher_signature_known(print)  # a builtin: not introspectable, so not known
