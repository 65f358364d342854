"""engram.triton_launch: the alignment-free jit and CompiledLaunch's keys (CPU checks;
the GPU tests run every CompiledLaunch with VERIFY_VARIANTS on, tests/conftest.py)."""

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


def test_int_variant_follows_triton_int_specialization():
    from engram.triton_launch import int_variant, integer_widths

    assert int_variant(1) == (False, True, False)
    assert int_variant(32) == (False, False, True)
    assert int_variant(2**31) == (True, False, True)
    assert integer_widths(5, -2**31, 2**31) == (False, False, True)


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

    from engram.triton_launch import CompiledLaunch, tensor_variant

    values = torch.zeros(999, device="cuda", dtype=torch.int32)
    compiled = CompiledLaunch(_add_two_kernel())
    variant = (tensor_variant(values), False)
    if bound:
        bound_launch = compiled.bind(variant, num_warps=4)
        launch = lambda grid: bound_launch(grid, (values, 999, 128))  # noqa: E731
    else:
        launch = lambda grid: compiled(grid, variant, (values, 999, 128), num_warps=4)  # noqa: E731
    for _ in range(3):  # compile, first warm launch (keeps the runner), direct launch
        launch(8)
    assert compiled._direct and (not bound or bound_launch._direct is not None), "no direct runner kept"
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

    from engram.triton_launch import CompiledLaunch, tensor_variant

    values = torch.zeros(37, dtype=torch.int32)
    bound = CompiledLaunch(_add_two_kernel()).bind((tensor_variant(values), False), num_warps=1)
    for _ in range(3):
        bound(3, (values, 37, 16))
    assert bound._direct is None
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
