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
