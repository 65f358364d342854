"""Which compiled binary Triton picks for a kernel's arguments: variant keys built from the
kernel's own specialization rules.

Triton compiles one binary per *specialization* of a call's arguments and picks it on every
``kernel[grid](...)``. :class:`~engram.triton_launch.CompiledLaunch` skips that per-call work, so
it must pick the same binary from a key of its own; a key that leaves out a fact Triton
specializes on launches a binary compiled for other arguments (e.g. one that assumes 16-byte
aligned stores on a misaligned output). :class:`VariantRule` reads the rules from the kernel's
parameters (constexprs, ``do_not_specialize``, ``do_not_specialize_on_alignment``) and applies
them to every argument. The rules, read off Triton 3.6 and 3.9 (the same in both;
``tests/core/test_triton_variants.py`` checks them against the installed Triton):

* constexpr: its value;
* pointer (a tensor): its dtype, and ``data_ptr() % 16 == 0`` unless the parameter is in
  ``do_not_specialize`` or ``do_not_specialize_on_alignment``;
* int: its type by range (i32 for ``[-2**31, 2**31)``, else i64 below 2**63, else u64); unless
  in ``do_not_specialize``, also ``value == 1`` (it becomes a constexpr) and, unless in
  ``do_not_specialize_on_alignment`` too, ``value % 16 == 0``;
* bool, float: the type alone; None: a constexpr.

A key is a tuple with one entry per parameter. For launches of one call structure (a prepared
call), :meth:`VariantRule.prepare` fixes everything but the pointers' alignment once, and
:meth:`PreparedVariant.alignment` reads only that per call.
"""

from __future__ import annotations

import inspect
from typing import Any, Hashable

__all__ = ["ALIGNMENT", "VariantRule", "PreparedVariant", "argument_key"]

ALIGNMENT = 16  # bytes: Triton's divisibility specialization of pointers and ints


def _int_type(value: int) -> str:
    if -2**31 <= value < 2**31:
        return "i32"
    return "i64" if -2**63 <= value < 2**63 else "u64"


def argument_key(value: Any, constexpr: bool, specialize: bool, align: bool) -> Hashable:
    """What Triton specializes one argument on (see the module docstring): a constexpr's type and
    value; a pointer's dtype and alignment; an int's type, ``== 1`` and ``% 16 == 0``."""
    if constexpr:
        return (value.__class__, value)  # the type too: 1, 1.0 and True are equal in Python
    cls = value.__class__
    if cls is bool:
        return "u1"
    if cls is int:
        if not specialize:
            return _int_type(value)
        return (_int_type(value), value == 1, align and value % ALIGNMENT == 0)
    if cls is float:
        return "fp32"
    if value is None:
        return None
    if hasattr(value, "data_ptr"):
        return (value.dtype, specialize and align and value.data_ptr() % ALIGNMENT == 0)
    return (cls, value)


def _parameter_rules(kernel) -> tuple[tuple[str, bool, bool, bool], ...]:
    """``(name, constexpr, specialize, align)`` per parameter of ``kernel``: a ``triton.jit``
    function, or under the interpreter an ``InterpretedFunction`` (which keeps the jit options
    but no parameter objects)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return tuple((p.name, bool(p.is_constexpr), not p.do_not_specialize,
                      not getattr(p, "do_not_specialize_on_alignment", False)) for p in params)
    options = getattr(kernel, "kwargs", {}) or {}
    skip_value = options.get("do_not_specialize") or ()
    skip_alignment = options.get("do_not_specialize_on_alignment") or ()
    rules = []
    for index, (name, parameter) in enumerate(inspect.signature(kernel.fn).parameters.items()):
        constexpr = "constexpr" in str(parameter.annotation)
        rules.append((name, constexpr, not (index in skip_value or name in skip_value),
                      not (index in skip_alignment or name in skip_alignment)))
    return tuple(rules)


class VariantRule:
    """The specialization rules of one kernel's parameters.

    ``key(args)``: the variant key of a call (``args``: every parameter in order, constexprs
    included), one entry per parameter. ``prepare(args)``: the :class:`PreparedVariant` of calls
    whose arguments differ from ``args`` in tensor addresses only.
    """

    def __init__(self, kernel):
        self.name = getattr(kernel, "__name__", type(kernel).__name__)
        self.rules = _parameter_rules(kernel)
        self._prepared: dict[tuple, PreparedVariant] = {}

    def _check_count(self, args: tuple) -> None:
        if len(args) != len(self.rules):
            raise TypeError(f"{self.name}: expected {len(self.rules)} arguments (every parameter, constexprs "
                            f"included), found {len(args)}")

    def key(self, args: tuple) -> tuple:
        """The variant key of ``args``: equal keys mean Triton picks the same binary."""
        self._check_count(args)
        return tuple(argument_key(value, constexpr, specialize, align)
                     for value, (_, constexpr, specialize, align) in zip(args, self.rules))

    def prepare(self, args: tuple) -> "PreparedVariant":
        """The variant of calls with ``args``' structure (dtypes, ints, constexprs): fixed here,
        except the alignment of the pointers whose alignment Triton specializes, which
        :meth:`PreparedVariant.alignment` reads per call. Equal structures share one object."""
        full = self.key(args)
        positions = tuple(index for index, (value, (_, constexpr, specialize, align)) in enumerate(zip(args, self.rules))
                          if not constexpr and specialize and align and value.__class__ not in (bool, int, float)
                          and hasattr(value, "data_ptr"))
        template = tuple((entry[0], None) if index in positions else entry for index, entry in enumerate(full))
        prepared = self._prepared.get((template, positions))
        if prepared is None:
            prepared = self._prepared[(template, positions)] = PreparedVariant(self, template, positions)
        return prepared


class PreparedVariant:
    """The variant of one call structure of a kernel (made by :meth:`VariantRule.prepare`).

    ``alignment(args)``: an int whose bits say which of the pointers at ``positions`` are 16-byte
    aligned (the only per-call part); ``(prepared, alignment(args))`` is then a complete key.
    ``expand(bits)`` gives the :meth:`VariantRule.key` it stands for; ``check(args, bits)`` raises
    when ``args`` do not have the structure the variant was prepared for. Compared by identity
    (equal structures share one object), so hashing it costs nothing per call.
    """

    __slots__ = ("rule", "template", "positions")

    def __init__(self, rule: VariantRule, template: tuple, positions: tuple[int, ...]):
        self.rule, self.template, self.positions = rule, template, positions

    def alignment(self, args: tuple) -> int:
        bits = 0
        for index in self.positions:
            bits = bits + bits + (args[index].data_ptr() % ALIGNMENT == 0)
        return bits

    def expand(self, bits: int) -> tuple:
        key = list(self.template)
        for shift, index in enumerate(reversed(self.positions)):
            key[index] = (key[index][0], bool(bits >> shift & 1))
        return tuple(key)

    def check(self, args: tuple, bits: int) -> None:
        expected = self.rule.key(args)
        if self.expand(bits) != expected:
            names = [name for (name, *_), a, b in zip(self.rule.rules, self.expand(bits), expected) if a != b]
            raise AssertionError(f"{self.rule.name}: arguments {names} differ from the structure this launch was "
                                 f"prepared for (a prepared launch would pick another binary)")

    def __repr__(self) -> str:
        return f"PreparedVariant({self.rule.name}, aligned positions {self.positions})"
