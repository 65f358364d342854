"""The Engram gate (docs/design.md §2 "Gate"): the fused Triton kernel on CUDA, plain torch
on the CPU and as the fallback.

Per token ``t`` and copy ``c``, in fp32, one rounding at the end::

    dot = sum(h * q_weight[c] * k_weight[c] * key) * rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps) / sqrt(D)
    out = h + sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))) * value

Masked tokens (``token_mask`` False) come out equal to their input bit for bit:
the output is selected (``torch.where`` / ``tl.where``), not computed with ``g = 0``.

Entry points:

* :func:`engram_gate` ``(hidden_states, key, value, ...)``: key ``[T, hc, D]`` and
  value ``[T, D]`` as separate tensors (views of ``kv`` are read in place).
* :func:`engram_gate_kv` ``(hidden_states, kv, ...)``: ``kv [T, (hc + 1) * D]`` as
  :class:`~engram.layer.wkv.WkvProjection` returns it; the kernel reads keys and value
  straight from it, with no split views.
* :func:`engram_gate_torch`: the torch path, always.

Dispatch: the ``backend`` argument (:mod:`engram.backends`), default ``"auto"``: the Triton
kernel for CUDA tensors of bf16/fp16/fp32, torch for CPU tensors or other dtypes (and,
with a warning once, for CUDA tensors where Triton is not installed); ``"triton"`` forces
the kernel (CPU tensors need ``TRITON_INTERPRET=1``), ``"torch"`` forces torch. The
kernel launch does no host sync: it can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch

from engram.backends import resolve_backend
from engram.call_cache import CallCache, structure
from engram.common import next_power_of_2
from engram.triton_launch import BoundLaunch, CompiledLaunch
from engram.tuning import tuning

__all__ = ["engram_gate", "engram_gate_kv", "engram_gate_torch", "gate_launch_config", "GateLaunchConfig"]

_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The default launch shape, read once from the device kind's tuning file (engram.tuning, keys gate.*).
_TUNED = tuning().gate
_COPIES_PER_PROGRAM, _ELEMENTS_PER_THREAD, _MAX_NUM_WARPS = (_TUNED.copies_per_program, _TUNED.elements_per_thread,
                                                             _TUNED.max_num_warps)
_EARLY_VALUE, _CACHE_HINTS = _TUNED.early_value, _TUNED.cache_hints


# ---- checks -----------------------------------------------------------------------
def _check_tensor(name: str, tensor, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, found {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: expected a floating dtype, found {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name}: expected device {device} (hidden_states'), found {tensor.device}")


def _check_common_inputs(hidden_states, q_weight, k_weight, token_mask) -> None:
    """hidden_states ``[T, hc, D]``, the weights ``[hc, D]`` and the mask ``[T]``."""
    if not isinstance(hidden_states, torch.Tensor):
        raise ValueError(f"hidden_states: expected a torch.Tensor, found {type(hidden_states).__name__}")
    _check_tensor("hidden_states", hidden_states, hidden_states.device)
    for name, tensor in (("q_weight", q_weight), ("k_weight", k_weight)):
        _check_tensor(name, tensor, hidden_states.device)
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states: expected shape [T, hc, D], found {list(hidden_states.shape)}")
    if hidden_states.dtype not in _HIDDEN_DTYPES:
        raise ValueError(f"hidden_states: expected dtype bfloat16, float16 or float32, found {hidden_states.dtype}")
    tokens, hc_mult, hidden = hidden_states.shape
    for name, tensor in (("q_weight", q_weight), ("k_weight", k_weight)):
        if list(tensor.shape) != [hc_mult, hidden]:
            raise ValueError(f"{name}: expected shape {[hc_mult, hidden]}, found {list(tensor.shape)}")
    if token_mask is not None:
        if not isinstance(token_mask, torch.Tensor) or token_mask.dtype != torch.bool:
            found = token_mask.dtype if isinstance(token_mask, torch.Tensor) else type(token_mask).__name__
            raise ValueError(f"token_mask: expected a torch.bool tensor [T] or None, found {found}")
        if list(token_mask.shape) != [tokens]:
            raise ValueError(f"token_mask: expected shape [{tokens}], found {list(token_mask.shape)}")
        if token_mask.device != hidden_states.device:
            raise ValueError(f"token_mask: expected device {hidden_states.device} (hidden_states'), found {token_mask.device}")


def _check_gate_inputs(hidden_states, key, value, q_weight, k_weight, token_mask) -> None:
    if isinstance(hidden_states, torch.Tensor):
        for name, tensor in (("key", key), ("value", value)):
            _check_tensor(name, tensor, hidden_states.device)
    _check_common_inputs(hidden_states, q_weight, k_weight, token_mask)
    tokens, hc_mult, hidden = hidden_states.shape
    for name, tensor, expected in (("key", key, [tokens, hc_mult, hidden]), ("value", value, [tokens, hidden])):
        if list(tensor.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected}, found {list(tensor.shape)}")


def _check_kv(hidden_states, kv) -> None:
    _check_tensor("kv", kv, hidden_states.device)
    tokens, hc_mult, hidden = hidden_states.shape
    expected = [tokens, (hc_mult + 1) * hidden]
    if list(kv.shape) != expected:
        raise ValueError(f"kv: expected shape {expected} ([T, (hc + 1) * D] with hc = {hc_mult}, D = {hidden}), "
                         f"found {list(kv.shape)}")


def _resolve_out(hidden_states, out_dtype, out):
    """The output dtype, and ``out`` checked (or None)."""
    if out_dtype is not None and (not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point):
        raise ValueError(f"out_dtype: expected a floating torch.dtype or None, found {out_dtype!r}")
    if out is None:
        return hidden_states.dtype if out_dtype is None else out_dtype, None
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out: expected a torch.Tensor or None, found {type(out).__name__}")
    if out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(f"out: expected dtype {out_dtype} (out_dtype), found {out.dtype}")
    if not out.is_floating_point():
        raise ValueError(f"out: expected a floating dtype, found {out.dtype}")
    if out.shape != hidden_states.shape:
        raise ValueError(f"out: expected shape {list(hidden_states.shape)}, found {list(out.shape)}")
    if out.device != hidden_states.device:
        raise ValueError(f"out: expected device {hidden_states.device} (hidden_states'), found {out.device}")
    return out.dtype, out


# ---- dispatch -----------------------------------------------------------------------
_GATE_LAUNCHER: list = []


def _gate_launcher():
    """The gate kernel's :class:`~engram.triton_launch.CompiledLaunch` (made on first use)."""
    if not _GATE_LAUNCHER:
        _GATE_LAUNCHER.append(CompiledLaunch(_triton_kernel()))
    return _GATE_LAUNCHER[0]


@functools.lru_cache(maxsize=1)
def _triton_kernel():
    """The jitted kernel (imported on first use; Triton is known to be importable then)."""
    from engram.layer.gate_kernels import engram_gate_kernel

    return engram_gate_kernel


def _use_triton(backend: str | None, hidden_states: torch.Tensor, tensors, out_dtype: torch.dtype) -> bool:
    """Whether this call runs the kernel (see the module docstring)."""
    if resolve_backend(backend, hidden_states.device, "the Engram gate") == "torch":
        return False
    if all(t.dtype in _KERNEL_DTYPES for t in tensors) and out_dtype in _KERNEL_DTYPES:
        return True
    if backend == "triton":
        found = sorted({str(t.dtype) for t in tensors} | {str(out_dtype)})
        raise ValueError(f"backend: 'triton' takes bfloat16, float16 or float32 tensors, found dtypes {found}")
    return False  # "auto": other dtypes run the torch path, as documented


def _head_block(hidden: int) -> int:
    """The largest power of two ``<= hidden``: the kernel's main block of the head dimension."""
    return 1 << (hidden.bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class GateLaunchConfig:
    """Launch shape of the gate kernel (see :mod:`engram.layer.gate_kernels`).

    copies_per_program: copies of one token per program (a divisor of hc);
    num_warps: warps per program; early_value: load the value row before the sums
    (else after them); cache_hints: L2 eviction hints (h, key evict_first; value,
    weights evict_last).
    """

    copies_per_program: int = 1
    num_warps: int = 8
    early_value: bool = False
    cache_hints: bool = False


@functools.lru_cache(maxsize=64)
def gate_launch_config(tokens: int, hc_mult: int, hidden: int) -> GateLaunchConfig:
    """The default :class:`GateLaunchConfig` (``tokens`` is kept for a per-T choice).

    The device kind's shape (:mod:`engram.tuning`, ``gate.*``); the H200's, the best of its sweep in
    ``benchmarks/NOTES.md`` ("Gate launch shapes"): one copy per program (``T * hc`` programs; at T = 1
    the hc copies run side by side), about 16 head elements per thread (8 warps at D = 5120, at most 16),
    value loaded after the sums, no eviction hints. A ``copies_per_program`` that does not divide ``hc``
    falls back to one.
    """
    head_block = _head_block(hidden)
    copies = _COPIES_PER_PROGRAM if hc_mult % _COPIES_PER_PROGRAM == 0 else 1
    return GateLaunchConfig(copies_per_program=copies,
                            num_warps=min(_MAX_NUM_WARPS, max(1, head_block // (32 * _ELEMENTS_PER_THREAD))),
                            early_value=_EARLY_VALUE, cache_hints=_CACHE_HINTS)


def _contiguous_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its last dimension is contiguous, else a contiguous copy."""
    return tensor if tensor.stride(-1) == 1 or tensor.shape[-1] <= 1 else tensor.contiguous()


def _launch_gate_kernel(
    hidden_states: torch.Tensor,
    key_source: torch.Tensor, key_token_stride: int, key_copy_stride: int,
    value_source: torch.Tensor, value_offset: int, value_token_stride: int,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    token_mask: torch.Tensor | None, out: torch.Tensor,
    config: GateLaunchConfig | None = None, *, compiled: list | None = None,
) -> torch.Tensor:
    """Launch :func:`~engram.layer.gate_kernels.engram_gate_kernel` into ``out``.

    ``key_source``/``value_source``: tensors whose last dimension is contiguous; copy
    ``c`` of token ``t``'s key starts at element ``t * key_token_stride + c * key_copy_stride``,
    its value at ``value_offset + t * value_token_stride``. ``config`` defaults to
    :func:`gate_launch_config`; ``compiled``, if given, receives the compiled kernel
    (registers, spills) for benchmarks.
    """
    tokens, hc_mult, hidden = hidden_states.shape
    if tokens == 0:
        return out
    config = gate_launch_config(tokens, hc_mult, hidden) if config is None else config
    copies = config.copies_per_program
    if copies < 1 or hc_mult % copies:
        raise ValueError(f"config.copies_per_program: expected a divisor of hc = {hc_mult}, found {copies}")
    head_block = _head_block(hidden)
    tail_block = next_power_of_2(hidden - head_block) if hidden > head_block else 0

    hidden_states = _contiguous_rows(hidden_states)
    q_weight, k_weight = _contiguous_rows(q_weight), _contiguous_rows(k_weight)
    if token_mask is not None:
        token_mask = token_mask.contiguous()  # bool: the kernel loads its bytes
    ints = (hidden_states.stride(0), hidden_states.stride(1), key_token_stride, key_copy_stride,
            value_offset, value_token_stride, q_weight.stride(0), k_weight.stride(0), out.stride(0), out.stride(1))
    constexprs = (hidden, hc_mult, copies, head_block, tail_block, token_mask is not None, config.early_value,
                  "evict_first" if config.cache_hints else "", "evict_last" if config.cache_hints else "")
    mask_or_placeholder = hidden_states if token_mask is None else token_mask
    tensors = (hidden_states, key_source, value_source, q_weight, k_weight, mask_or_placeholder, out)
    kernel = _gate_launcher()(tokens * (hc_mult // copies), (*tensors, *ints, float(eps), math.sqrt(hidden), *constexprs),
                              num_warps=config.num_warps,
                              device_index=hidden_states.device.index if hidden_states.is_cuda else 0)
    if compiled is not None:
        compiled.append(kernel)
    return out


def _kernel_out(hidden_states: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(hidden_states.shape, dtype=out_dtype, device=hidden_states.device)
    if out.stride(-1) != 1 and out.shape[-1] > 1:
        raise ValueError(f"out: expected a contiguous last dimension for the Triton kernel, found strides {out.stride()}")
    return out


# ---- entry points -----------------------------------------------------------------------
def _gate_torch(hidden_states, key, value, q_weight, k_weight, eps, token_mask, out_dtype, out):
    """The torch math on checked inputs."""
    hidden = hidden_states.shape[-1]
    h = hidden_states.to(torch.float32)
    k = key.to(torch.float32)
    w = q_weight.to(torch.float32) * k_weight.to(torch.float32)         # [hc, D]; exact for bf16 inputs
    raw_dot = (h * w * k).sum(dim=-1)                                    # [T, hc]
    h_scale = torch.rsqrt((h * h).mean(dim=-1) + eps)                    # [T, hc]
    key_scale = torch.rsqrt((k * k).mean(dim=-1) + eps)                  # [T, hc]
    dot = raw_dot * h_scale * key_scale / math.sqrt(hidden)              # [T, hc]
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
    result = (h + gate[:, :, None] * value.to(torch.float32)[:, None, :]).to(out_dtype)
    if token_mask is not None:
        result = torch.where(token_mask[:, None, None], result, hidden_states.to(out_dtype))
    if out is None:
        return result
    out.copy_(result)
    return out


def engram_gate_torch(
    hidden_states: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [T, hc, D] = h + g * value`` in plain torch (any device); arguments as :func:`engram_gate`."""
    _check_gate_inputs(hidden_states, key, value, q_weight, k_weight, token_mask)
    out_dtype, out = _resolve_out(hidden_states, out_dtype, out)
    return _gate_torch(hidden_states, key, value, q_weight, k_weight, eps, token_mask, out_dtype, out)


def engram_gate(
    hidden_states: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``out [T, hc, D] = h + g * value``, fp32 math, rounded once to ``out_dtype``.

    Args:
        hidden_states: ``h``, bf16/fp16/fp32 ``[T, hc, D]``.
        key: ``[T, hc, D]``, value: ``[T, D]`` (bf16 from ``wkv``; any float dtype;
            strided views of ``kv`` are read in place by the kernel).
        q_weight, k_weight: ``[hc, D]`` (bf16 in checkpoints).
        eps: ``rms_norm_eps``.
        token_mask: bool ``[T]``, False = masked (output = input, bit for bit); None = all tokens.
        out_dtype: dtype of the result; default ``hidden_states.dtype`` (or ``out``'s).
        out: optional ``[T, hc, D]`` tensor to write (fixed buffers, CUDA graphs); may
            be ``hidden_states`` itself (an in-place update: each row is read before it is written).
        backend: ``"auto"`` (default; None means the same), ``"triton"`` or ``"torch"``
            (see the module docstring).

    Returns:
        ``out``, or a new tensor ``[T, hc, D]`` of ``out_dtype``.
    """
    _check_gate_inputs(hidden_states, key, value, q_weight, k_weight, token_mask)
    out_dtype, out = _resolve_out(hidden_states, out_dtype, out)
    if not _use_triton(backend, hidden_states, (hidden_states, key, value, q_weight, k_weight), out_dtype):
        return _gate_torch(hidden_states, key, value, q_weight, k_weight, eps, token_mask, out_dtype, out)
    key, value = _contiguous_rows(key), _contiguous_rows(value)
    return _launch_gate_kernel(hidden_states, key, key.stride(0), key.stride(1), value, 0, value.stride(0),
                               q_weight, k_weight, eps, token_mask, _kernel_out(hidden_states, out_dtype, out))


def engram_gate_kv(
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """:func:`engram_gate` with keys and value read from ``kv [T, (hc + 1) * D]``
    (``kv[:, c*D:(c+1)*D]`` = copy ``c``'s key, ``kv[:, hc*D:]`` = the value; see
    :func:`~engram.layer.wkv.split_kv`). Other arguments and the result as :func:`engram_gate`.
    """
    if out is None and (out_dtype is None or isinstance(out_dtype, torch.dtype)) and isinstance(backend, (str, type(None))):
        key = (structure(hidden_states), structure(kv), structure(q_weight), structure(k_weight),
               structure(token_mask), out_dtype, backend)
        plan = _KV_PLANS.get(key)
        if plan is None:
            plan = _plan_gate_kv(hidden_states, kv, q_weight, k_weight, token_mask, out_dtype, backend)
            if plan is not None:
                _KV_PLANS.put(key, plan)
        if plan is not None:
            return _run_gate_kv(plan, hidden_states, kv, q_weight, k_weight, eps, token_mask)
    return _engram_gate_kv_checked(hidden_states, kv, q_weight, k_weight, eps, token_mask, out_dtype, out, backend)


def _engram_gate_kv_checked(hidden_states, kv, q_weight, k_weight, eps, token_mask, out_dtype, out, backend):
    """:func:`engram_gate_kv`, every check on this call."""
    _check_common_inputs(hidden_states, q_weight, k_weight, token_mask)
    _check_kv(hidden_states, kv)
    out_dtype, out = _resolve_out(hidden_states, out_dtype, out)
    tokens, hc_mult, hidden = hidden_states.shape
    if not _use_triton(backend, hidden_states, (hidden_states, kv, q_weight, k_weight), out_dtype):
        key = kv[:, : hc_mult * hidden].unflatten(1, (hc_mult, hidden))
        value = kv[:, hc_mult * hidden:]
        return _gate_torch(hidden_states, key, value, q_weight, k_weight, eps, token_mask, out_dtype, out)
    kv = _contiguous_rows(kv)
    return _launch_gate_kernel(hidden_states, kv, kv.stride(0), hidden, kv, hc_mult * hidden, kv.stride(0),
                               q_weight, k_weight, eps, token_mask, _kernel_out(hidden_states, out_dtype, out))


# ---- engram_gate_kv, planned once per call structure ------------------------------------
class _GateKvPlan(NamedTuple):
    """What :func:`engram_gate_kv` decides from its arguments' structure (:mod:`engram.call_cache`)."""

    out_dtype: torch.dtype
    triton: bool
    grid: int
    ints: tuple
    constexprs: tuple
    num_warps: int
    device_index: int
    sqrt_hidden: float
    launch: BoundLaunch | None  # the Triton launches of this structure (variant from the kernel's rules)


_KV_PLANS = CallCache()


def _plan_gate_kv(hidden_states, kv, q_weight, k_weight, token_mask, out_dtype, backend) -> _GateKvPlan | None:
    """Check the arguments and decide the launch; None where the call copies an argument (those
    run the checked path on every call)."""
    _check_common_inputs(hidden_states, q_weight, k_weight, token_mask)
    _check_kv(hidden_states, kv)
    out_dtype, _ = _resolve_out(hidden_states, out_dtype, None)
    tokens, hc_mult, hidden = hidden_states.shape
    if not _use_triton(backend, hidden_states, (hidden_states, kv, q_weight, k_weight), out_dtype):
        return _GateKvPlan(out_dtype, False, 0, (), (), 0, 0, 0.0, None)
    if any(t is not _contiguous_rows(t) for t in (hidden_states, kv, q_weight, k_weight)):
        return None
    if token_mask is not None and not token_mask.is_contiguous():
        return None
    config = gate_launch_config(tokens, hc_mult, hidden)
    copies = config.copies_per_program
    head_block = _head_block(hidden)
    tail_block = next_power_of_2(hidden - head_block) if hidden > head_block else 0
    # out is new: contiguous, strides (hc * D, D).
    ints = (hidden_states.stride(0), hidden_states.stride(1), kv.stride(0), hidden, hc_mult * hidden, kv.stride(0),
            q_weight.stride(0), k_weight.stride(0), hc_mult * hidden, hidden)
    constexprs = (hidden, hc_mult, copies, head_block, tail_block, token_mask is not None, config.early_value,
                  "evict_first" if config.cache_hints else "", "evict_last" if config.cache_hints else "")
    device_index = hidden_states.device.index if hidden_states.is_cuda else 0
    return _GateKvPlan(out_dtype, True, tokens * (hc_mult // copies), ints, constexprs, config.num_warps, device_index,
                       math.sqrt(hidden), _gate_launcher().bind(config.num_warps, device_index))


def prepare_gate_kv(hidden_states, kv, q_weight, k_weight, token_mask=None, *, backend=None):
    """``prepared(hidden_states, kv, q_weight, k_weight, eps, token_mask) -> out``, equal to
    :func:`engram_gate_kv` with ``backend`` (a new output of ``hidden_states``' dtype) for every call
    whose arguments have these ones' structure: checked and planned once. None where such calls
    copy an argument (they take :func:`engram_gate_kv`)."""
    plan = _plan_gate_kv(hidden_states, kv, q_weight, k_weight, token_mask, None, backend)
    if plan is None:
        return None
    if not plan.triton or not plan.grid:
        return functools.partial(_run_gate_kv, plan)
    return _PreparedGate(plan)


class _PreparedGate:
    """:func:`_run_gate_kv` of one Triton plan, through the plan's bound launch (which reads each
    pointer's 16-byte alignment per call: the kernel's only per-call variant choice)."""

    __slots__ = ("_plan",)

    def __init__(self, plan: _GateKvPlan):
        self._plan = plan

    def __call__(self, hidden_states, kv, q_weight, k_weight, eps, token_mask) -> torch.Tensor:
        plan = self._plan
        out = torch.empty(hidden_states.shape, dtype=plan.out_dtype, device=hidden_states.device)
        mask = hidden_states if token_mask is None else token_mask  # bool, read as bytes (no view op per call)
        plan.launch(plan.grid, (hidden_states, kv, kv, q_weight, k_weight, mask, out, *plan.ints, float(eps),
                                plan.sqrt_hidden, *plan.constexprs))
        return out


def _run_gate_kv(plan: _GateKvPlan, hidden_states, kv, q_weight, k_weight, eps, token_mask) -> torch.Tensor:
    if not plan.triton:
        tokens, hc_mult, hidden = hidden_states.shape
        key = kv[:, : hc_mult * hidden].unflatten(1, (hc_mult, hidden))
        return _gate_torch(hidden_states, key, kv[:, hc_mult * hidden:], q_weight, k_weight, eps, token_mask,
                           plan.out_dtype, None)
    out = torch.empty(hidden_states.shape, dtype=plan.out_dtype, device=hidden_states.device)
    if not plan.grid:
        return out
    mask = hidden_states if token_mask is None else token_mask  # bool, read as bytes (no view op per call)
    plan.launch(plan.grid, (hidden_states, kv, kv, q_weight, k_weight, mask, out, *plan.ints, float(eps),
                            plan.sqrt_hidden, *plan.constexprs))
    return out
