"""engram.triton_variants: variant keys built from a kernel's own specialization rules, checked
against the installed Triton's specializer (CPU; no kernel runs)."""

from __future__ import annotations

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")


def _probe_function():
    import triton.language as tl

    def probe(pointer, other, count, stride, BLOCK: tl.constexpr, MODE: tl.constexpr):
        tl.store(pointer + tl.arange(0, BLOCK), tl.load(other + tl.arange(0, BLOCK)) + count + stride)

    return probe


# Kernels of one signature under each way of excluding a parameter from specialization.
KERNEL_OPTIONS = {
    "plain": {},
    "do_not_specialize count": {"do_not_specialize": ["count"]},
    "no alignment: pointer, count": {"do_not_specialize_on_alignment": ["pointer", "count"]},
    "both on stride, by index": {"do_not_specialize": [3], "do_not_specialize_on_alignment": [3]},
}


def _triton_specialization(kernel, args) -> list:
    """What the installed Triton specializes ``args`` on: its own binder's specialization list."""
    import inspect

    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(inspect.signature(kernel.fn), kernel.params, BaseBackend)
    return binder(*args)[1]


def _values() -> list:
    """Every kind of non-constexpr argument, on both sides of each specialization boundary."""
    words = torch.zeros(64, dtype=torch.int32)
    halves = torch.zeros(64, dtype=torch.float16)
    tensors = [words, words[1:], words[4:], halves, halves[1:], halves[8:]]  # 16-byte aligned or not
    ints = [0, 1, 2, 15, 16, 17, 48, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
            2**63 - 16, 2**63, 2**64 - 16]
    return tensors + ints + [True, False, 0.5, 2.0, None]


def _base_args():
    return (torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), 5, 7, 16, "a")


@pytest.mark.parametrize("options", KERNEL_OPTIONS.values(), ids=KERNEL_OPTIONS.keys())
def test_keys_differ_exactly_where_triton_specializes(options):
    """For each parameter and each pair of values: Triton's specialization differs if and only if
    the variant key does (constexprs: the key may also tell apart values of different types)."""
    from engram.triton_variants import VariantRule

    kernel = triton.jit(**options)(_probe_function())
    rule = VariantRule(kernel)
    base = _base_args()
    constexpr_values = {4: [16, 32, 64], 5: ["a", "b", "", "evict_first"]}
    for position in range(len(base)):
        values = constexpr_values.get(position, _values())
        for first, second in itertools.combinations(values, 2):
            args_a = base[:position] + (first,) + base[position + 1:]
            args_b = base[:position] + (second,) + base[position + 1:]
            triton_differs = _triton_specialization(kernel, args_a) != _triton_specialization(kernel, args_b)
            key_differs = rule.key(args_a) != rule.key(args_b)
            assert triton_differs == key_differs, (
                f"{kernel.fn.__name__} {options}: parameter {rule.rules[position][0]}, values {first!r} and "
                f"{second!r}: Triton {'tells them apart' if triton_differs else 'does not'}, the key "
                f"{'does' if key_differs else 'does not'}")


def test_rules_are_read_the_same_from_an_interpreted_kernel():
    """Under the interpreter a kernel is an InterpretedFunction (no parameter objects): the rules
    come from its jit options and annotations, the same as from the compiled kernel's parameters."""
    from triton.runtime.interpreter import InterpretedFunction

    from engram.triton_variants import VariantRule

    for options in KERNEL_OPTIONS.values():
        function = _probe_function()
        assert VariantRule(InterpretedFunction(function, **options)).rules == VariantRule(
            triton.jit(**options)(function)).rules, options


def test_prepared_variants_read_alignment_per_call_and_check_the_rest():
    """A prepared variant fixes dtypes, ints and constexprs; per call it reads the alignment of the
    pointers whose alignment is specialized, and with it stands for the full key. Arguments of
    another structure are refused by ``check``."""
    from engram.triton_variants import VariantRule

    kernel = triton.jit(do_not_specialize_on_alignment=["other"])(_probe_function())
    rule = VariantRule(kernel)
    words = torch.zeros(64, dtype=torch.int32)
    prepared = rule.prepare((words, words, 5, 32, 16, "a"))
    assert prepared.positions == (0,)  # "other" is not specialized on alignment; ints are fixed
    assert rule.prepare((words[4:], words[1:], 5, 32, 16, "a")) is prepared  # one object per structure
    for pointer, other in itertools.product((words, words[1:], words[4:]), repeat=2):
        args = (pointer, other, 5, 32, 16, "a")
        bits = prepared.alignment(args)
        assert prepared.expand(bits) == rule.key(args)
        prepared.check(args, bits)
    for changed, name in (((words, words, 5, 33, 16, "a"), "stride"), ((words, words, 1, 32, 16, "a"), "count"),
                          ((words.float(), words, 5, 32, 16, "a"), "pointer"), ((words, words, 5, 32, 16, "b"), "MODE")):
        with pytest.raises(AssertionError, match=name):
            prepared.check(changed, prepared.alignment(changed))
    with pytest.raises(TypeError, match="expected 6 arguments"):
        rule.key((words, words, 5))


def test_the_project_kernels_specialize_as_their_launchers_expect():
    """The hash kernels read gathers only and specialize on no pointer's alignment (a prepared hash
    reads no address per call); the gather kernels specialize every pointer, outputs included."""
    from engram.hashing import kernels as hash_kernels
    from engram.table.kernels import gather_kernels as table_kernels
    from engram.triton_variants import VariantRule

    for kernel in (hash_kernels.ngram_hash_kernel, hash_kernels.slot_write_kernel, hash_kernels.history_write_kernel):
        assert not [name for name, constexpr, specialize, align in VariantRule(kernel).rules
                    if name.endswith("_ptr") and align], kernel
    for kernel, outputs in ((table_kernels.gather_rows_bf16_kernel, ["out_ptr"]),
                            (table_kernels.gather_rows_packed_kernel, ["out_value_ptr", "out_scale_ptr"])):
        rules = VariantRule(kernel).rules
        pointers = [name for name, *_ in rules if name.endswith("_ptr")]
        specialized = [name for name, constexpr, specialize, align in rules if specialize and align and name in pointers]
        assert specialized == pointers and set(outputs) <= set(pointers), (kernel, specialized)
