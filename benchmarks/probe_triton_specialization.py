"""Print what the installed Triton specializes a kernel's arguments on, and the signature of the
C launcher that :class:`engram.triton_launch.CompiledLaunch` calls directly.

Usage: ``python benchmarks/probe_triton_specialization.py`` (on a CUDA machine for the launcher
and the compiled-binary checks; the specializer table is printed anywhere).

The binary checks launch one small kernel with pairs of arguments that differ in one property
(an int's value 1 / 16 / other, a pointer's 16-byte alignment, with and without
``do_not_specialize`` / ``do_not_specialize_on_alignment``) and print whether Triton compiled a
second binary for the pair.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl


def specializer_table() -> None:
    try:
        from triton._C.libtriton import native_specialize_impl as specialize
    except ImportError:
        specialize = None
    print("triton", triton.__version__, "torch", torch.__version__)
    if specialize is None:
        from triton.runtime import jit

        print("no native_specialize_impl; jit.py specialization source:")
        for name in ("create_specialize_impl", "specialize_impl", "mangle_type"):
            if hasattr(jit, name):
                print(inspect.getsource(getattr(jit, name)))
        return
    from triton.backends.compiler import BaseBackend

    print(inspect.getsource(BaseBackend.get_int_specialization))
    print(inspect.getsource(BaseBackend.get_tensor_specialization))
    print("value: specialize(align) for (specialize, align) in TT TF FT FF")
    for value in (0, 1, 2, 16, 17, 32, -16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1, 2**63 - 1, 2**63,
                  True, 1.0, None):
        print(f"  {value!r}:", [specialize(BaseBackend, value, False, s, a) for s in (True, False)
                                for a in (True, False)])
    tensor = torch.zeros(8, dtype=torch.int32)
    for name, t in (("aligned tensor", tensor), ("misaligned tensor", tensor[1:])):
        print(f"  {name}:", [specialize(BaseBackend, t, False, s, a) for s in (True, False) for a in (True, False)])


@triton.jit
def _probe(pointer, a, b, c, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(pointer + offsets, tl.load(pointer + offsets) + a + b + c)


def binary_checks() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: binary checks skipped")
        return
    kernels = {
        "plain": _probe,
        "do_not_specialize a": triton.jit(do_not_specialize=["a"])(_probe.fn),
        "do_not_specialize_on_alignment pointer, a": triton.jit(
            do_not_specialize_on_alignment=["pointer", "a"])(_probe.fn),
    }
    buffer = torch.zeros(64, device="cuda", dtype=torch.int32)
    aligned, misaligned = buffer[:32], buffer[1:33]
    for label, kernel in kernels.items():
        base = kernel.warmup(aligned, 5, 5, 5, BLOCK=16, grid=(1,))
        for what, args in (("a=1", (aligned, 1, 5, 5)), ("a=16", (aligned, 16, 5, 5)), ("a=2**31", (aligned, 2**31, 5, 5)),
                           ("b=1", (aligned, 5, 1, 5)), ("b=32", (aligned, 5, 32, 5)),
                           ("misaligned pointer", (misaligned, 5, 5, 5))):
            other = kernel.warmup(*args, BLOCK=16, grid=(1,))
            print(f"{label}: {what} vs a=b=c=5 aligned -> {'another binary' if other is not base else 'same binary'}")
    compiled = _probe[(1,)](aligned, 5, 5, 5, BLOCK=16)
    run = compiled.run
    print("launcher:", type(run).__module__, type(run).__qualname__)
    try:
        print("launcher signature:", inspect.signature(run))
    except (TypeError, ValueError) as error:
        print("launcher signature: not inspectable:", error)
    print("CompiledKernel has function/packed_metadata:", hasattr(compiled, "function"),
          hasattr(compiled, "packed_metadata"))


if __name__ == "__main__":
    specializer_table()
    binary_checks()
