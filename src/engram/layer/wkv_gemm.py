"""Launchers of the FP8 ``wkv`` kernels (:mod:`engram.layer.wkv_kernels`) and the
``torch._scaled_mm`` block-scaled GEMM, with its one-time support probe.

* :func:`quantize_gathered_rows`: table rows (by hash id) or packed rows -> E4M3 activations with
  1 x 128 power-of-two scales (path (a), activation side).
* :func:`scaled_mm_gemm`: ``torch._scaled_mm`` with 1 x 128 activation / 128 x 128 weight scales
  (cuBLAS >= 12.9 on sm90; layouts probed once by :func:`probe_scaled_mm_blockwise`).
* :func:`block_scaled_gemm`: the same GEMM as a Triton kernel (any build, the interpreter too).
* :func:`small_m_gemm`: the same GEMM for few tokens (T <= :data:`SMALL_M_MAX_TOKENS`), split
  along K so that the weight streams from every SM (kernels in :mod:`~engram.layer.wkv_small_m_kernels`).
* :func:`fused_gather_gemm`: path (b), rows read by hash id straight into the GEMM.

Every launcher runs where its tensors are (CUDA, or the CPU under ``TRITON_INTERPRET=1``), never
syncs with the host, allocates only its outputs and can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from engram.call_cache import CallCache, structure
from engram.checks import check_bool, check_int, check_launch_ids, check_positive_int, check_power_of_two
from engram.table.fp8 import BLOCK_SIZE
from engram.triton_launch import BoundLaunch, CompiledLaunch, interpreting
from engram.tuning import tuning
from engram.layer.wkv_kernels import block_scaled_gemm_kernel, fused_gather_gemm_kernel, gather_quantize_kernel
from engram.layer.wkv_small_m_kernels import small_m_gemm_kernel, split_k_reduce_kernel
# The torch._scaled_mm path (and the activation rows both paths use) lives in engram.layer.scaled_mm.
from engram.layer.scaled_mm import (MIN_ACTIVATION_ROWS, ScaledMmLayout, padded_tokens,  # noqa: F401
                                    probe_scaled_mm_blockwise, scaled_mm_gemm, scaled_mm_gemm_transposed,
                                    scaled_mm_weight_scale)

__all__ = [
    "ACTIVATION_GROUP",
    "WkvGemmConfig",
    "default_gemm_config",
    "padded_tokens",
    "quantize_gathered_rows",
    "block_scaled_gemm",
    "SMALL_M_MAX_TOKENS",
    "SmallMGemmConfig",
    "default_small_m_config",
    "small_m_gemm",
    "scaled_mm_gemm",
    "scaled_mm_gemm_transposed",
    "fused_gather_gemm",
    "probe_scaled_mm_blockwise",
    "ScaledMmLayout",
]

ACTIVATION_GROUP = 128
"""Values per activation scale of path (a) (1 x 128 groups, the DeepSeek FP8 recipe)."""
@dataclass(frozen=True)
class WkvGemmConfig:
    """Tile shape of the GEMM kernels: ``block_m x block_n`` outputs per program, ``group_m``
    row tiles per column sweep (L2 reuse), ``num_warps``, ``num_stages`` (software pipeline)."""

    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "group_m", "num_warps"):
            check_power_of_two(f"WkvGemmConfig.{name}", getattr(self, name))
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"WkvGemmConfig: block_m and block_n must be >= 16 (tl.dot), "
                             f"found {self.block_m} x {self.block_n}")
        check_positive_int("WkvGemmConfig.num_stages", self.num_stages)


SMALL_M_MAX_TOKENS = 128
"""Most tokens :func:`small_m_gemm` is meant for (and :class:`~engram.layer.WkvProjection` sends
it when enabled): one row tile of <= 128 tokens, so the weight is read once; beyond that each
further row tile reads it again and cuBLAS's / the 128 x 128-tile GEMM is the better choice."""

SMALL_M_REDUCTIONS = ("partials", "atomic")


@dataclass(frozen=True)
class SmallMGemmConfig:
    """Launch shape of :func:`small_m_gemm`: ``block_n`` weight rows (outputs) per program,
    ``split_k`` K slices (each a multiple of 128; fewer when K has fewer 128-groups),
    ``num_warps``, ``num_stages`` (software pipeline depth), ``swap_ab`` (``W @ a.T`` in the
    kernel: the weight tile is the MMA's M side), and how splits are added: ``"partials"``
    (fp32 slice per split, then a reduce launch: fixed order, bit-reproducible) or ``"atomic"``
    (fp32 atomics into a zeroed buffer, then a cast launch: adds in arrival order)."""

    block_n: int = 128
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = True
    reduction: str = "partials"

    def __post_init__(self):
        for name in ("block_n", "split_k", "num_warps"):
            check_power_of_two(f"SmallMGemmConfig.{name}", getattr(self, name))
        if self.block_n < 16:
            raise ValueError(f"SmallMGemmConfig.block_n: must be >= 16 (tl.dot), found {self.block_n}")
        check_positive_int("SmallMGemmConfig.num_stages", self.num_stages)
        check_bool("SmallMGemmConfig.swap_ab", self.swap_ab)
        if self.reduction not in SMALL_M_REDUCTIONS:
            raise ValueError(f"SmallMGemmConfig.reduction: expected one of {SMALL_M_REDUCTIONS}, "
                             f"found {self.reduction!r}")


# Launch shapes read once from the device kind's tuning file (engram.tuning, keys wkv.*; each cites its
# measurement or says it is a first guess).
_TUNED = tuning().wkv


def _small_m_config(shape) -> SmallMGemmConfig:
    return SmallMGemmConfig(block_n=shape.block_n, split_k=shape.split_k, num_warps=shape.num_warps,
                            num_stages=shape.num_stages)


# First guesses (the H200 sweep of the path: benchmarks/NOTES.md, "Findings of removed probes"): at
# V4.1's N = 25600, 128-wide column tiles give 200 tiles; 4 (2) K splits make 800 (400) programs
# on 132 SMs, 12 (24) 128-deep steps each.
_SMALL_M_GPU_CONFIGS = (  # (largest T, config)
    *((band.max_tokens, _small_m_config(band)) for band in _TUNED.small_m_by_tokens),
    (None, _small_m_config(_TUNED.small_m_largest)),
)


def default_small_m_config(tokens: int) -> SmallMGemmConfig:
    """Launch shape of :func:`small_m_gemm` for ``T`` tokens (32-wide tiles, two splits and one
    stage under the interpreter, to exercise the reduction cheaply)."""
    if interpreting():
        return SmallMGemmConfig(block_n=32, split_k=2, num_warps=4, num_stages=1)
    for limit, config in _SMALL_M_GPU_CONFIGS:
        if limit is None or tokens <= limit:
            return config
    raise AssertionError("unreachable")


def small_m_block_m(tokens: int) -> int:
    """Rows per program of :func:`small_m_gemm`: ``T`` rounded up to a power of two, 16..128."""
    return min(128, max(16, triton.next_power_of_2(max(tokens, 1))))


def _gemm_config(shape) -> WkvGemmConfig:
    return WkvGemmConfig(block_m=shape.block_m, block_n=shape.block_n, group_m=shape.group_m,
                         num_warps=shape.num_warps, num_stages=shape.num_stages)


# Not yet measured on a GPU; benchmarks/layer/bench_layer.py sweeps
# the fused kernel's shapes at T = 64 and 8192 and records them for this table.
_GPU_CONFIGS = (  # (largest T, config)
    *((band.max_tokens, _gemm_config(band)) for band in _TUNED.gemm_by_tokens),
    (None, _gemm_config(_TUNED.gemm_largest)),
)
_FUSED_EXTRA_STAGES = _TUNED.fused_extra_stages


def default_gemm_config(tokens: int, fused: bool) -> WkvGemmConfig:
    """Tile shape for ``T`` tokens: small tiles for decode, 128 x 128 for prefill (more pipeline
    stages for the fused kernel, whose steps are 32 deep instead of 128); 16 x 32 tiles under
    the interpreter (about 1 ms per program instance)."""
    if interpreting():
        return WkvGemmConfig(block_m=16, block_n=32, group_m=2, num_warps=4, num_stages=1)
    for limit, config in _GPU_CONFIGS:
        if limit is None or tokens <= limit:
            return dataclasses.replace(config, num_stages=config.num_stages + _FUSED_EXTRA_STAGES) if fused else config
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------
def _check_rows_source(values, scales, hash_ids, row_start):
    """``(value_bytes [R, D], scale_bytes [R, D / 32], ids [T, C] or None, T, C)``.

    ``hash_ids`` None: ``values`` / ``scales`` are packed rows ``[T, C, D]`` / ``[T, C, D / 32]``."""
    from engram.table.fp8 import as_scale_bytes, as_value_bytes

    value_bytes = as_value_bytes(values, "values")
    scale_bytes = as_scale_bytes(scales, "scales")
    if hash_ids is None:
        if value_bytes.dim() != 3:
            raise ValueError(f"values: expected packed rows [T, C, head_dim], found {list(value_bytes.shape)}")
        tokens, columns, head_dim = value_bytes.shape
        if tuple(scale_bytes.shape) != (tokens, columns, head_dim // BLOCK_SIZE):
            raise ValueError(f"scales: expected shape {[tokens, columns, head_dim // BLOCK_SIZE]}, "
                             f"found {list(scale_bytes.shape)}")
        value_bytes = value_bytes.reshape(tokens * columns, head_dim)
        scale_bytes = scale_bytes.reshape(tokens * columns, head_dim // BLOCK_SIZE)
    else:
        if value_bytes.dim() != 2:
            raise ValueError(f"values: expected table rows [rows, head_dim], found {list(value_bytes.shape)}")
        head_dim = value_bytes.shape[1]
        if tuple(scale_bytes.shape) != (value_bytes.shape[0], head_dim // BLOCK_SIZE):
            raise ValueError(f"scales: expected shape {[value_bytes.shape[0], head_dim // BLOCK_SIZE]}, "
                             f"found {list(scale_bytes.shape)}")
        check_launch_ids(hash_ids)
        if hash_ids.device != value_bytes.device:
            raise ValueError(f"hash_ids: expected device {value_bytes.device} (the rows'), found {hash_ids.device}")
        tokens, columns = hash_ids.shape
    if head_dim == 0 or head_dim % BLOCK_SIZE:
        raise ValueError(f"values: head_dim must be a positive multiple of {BLOCK_SIZE}, found {head_dim}")
    if value_bytes.stride(-1) != 1 or scale_bytes.stride(-1) != 1:
        raise ValueError(f"values/scales: rows must be contiguous (last stride 1), found strides "
                         f"{value_bytes.stride()} and {scale_bytes.stride()}")
    check_int("row_start", row_start, 0)
    if scale_bytes.device != value_bytes.device:
        raise ValueError(f"scales: expected device {value_bytes.device} (the values'), found {scale_bytes.device}")
    return value_bytes, scale_bytes, hash_ids, tokens, columns


def _check_weight(weight, weight_scale, block_size, in_features, step):
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight: expected a float8_e4m3fn [N, K] tensor with contiguous rows, "
                         f"found {weight.dtype} {list(weight.shape)} strides {weight.stride()}")
    if weight.shape[1] != in_features:
        raise ValueError(f"weight: expected K = {in_features} input features (C * head_dim of the rows), "
                         f"found shape {list(weight.shape)}")
    block_n, block_k = block_size
    if block_k % step:
        raise ValueError(f"block_size: expected weight blocks {step}-aligned along K for this kernel, found {block_size}")
    expected = (-(-weight.shape[0] // block_n), -(-in_features // block_k))
    if (weight_scale.dtype != torch.float32 or weight_scale.dim() != 2 or weight_scale.shape[0] != expected[0]
            or weight_scale.shape[1] < expected[1] or weight_scale.stride(1) != 1):
        raise ValueError(f"weight_scale: expected fp32 [{expected[0]}, >= {expected[1]}] with contiguous rows, "
                         f"found {weight_scale.dtype} {list(weight_scale.shape)}")
    if weight.device != weight_scale.device:
        raise ValueError(f"weight_scale: expected device {weight.device} (the weight's), found {weight_scale.device}")


def _check_activations(a, a_scale, tokens) -> tuple[int, int]:
    """``(padded_T, K)`` of :func:`quantize_gathered_rows`'s ``(a, a_scale)``, checked."""
    if a.dtype != torch.float8_e4m3fn or a.dim() != 2 or not a.is_contiguous():
        raise ValueError(f"a: expected a contiguous float8_e4m3fn [padded_T, K] tensor, found {a.dtype} {list(a.shape)}")
    padded, in_features = a.shape
    groups = -(-in_features // ACTIVATION_GROUP)
    if (a_scale.dtype != torch.float32 or list(a_scale.shape) != [padded, groups]
            or a_scale.stride() != (1, padded)):
        raise ValueError(f"a_scale: expected the column-major fp32 [{padded}, {groups}] view of "
                         f"quantize_gathered_rows, found {a_scale.dtype} shape {list(a_scale.shape)} "
                         f"strides {a_scale.stride()}")
    if not 0 <= tokens <= padded:
        raise ValueError(f"tokens: expected 0..{padded} (rows of a), found {tokens}")
    return padded, in_features


def _kv_out(out, tokens, out_features, device):
    if out is None:
        return torch.empty(tokens, out_features, dtype=torch.bfloat16, device=device)
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or list(out.shape) != [tokens, out_features]
            or not out.is_contiguous() or out.device != device):
        found = f"{out.dtype} {list(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out: expected a contiguous torch.bfloat16 tensor [{tokens}, {out_features}] on {device}, "
                         f"found {found}")
    return out


def _on_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: a context for ``tensor``'s device."""
    if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    import contextlib
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------
class _QuantizePlan(NamedTuple):
    """What a :func:`quantize_gathered_rows` call of one structure launches (see
    :mod:`engram.call_cache`)."""

    padded: int
    in_features: int
    groups: int
    grid: tuple[int, int]
    ints: tuple
    constexprs: tuple
    num_warps: int
    ids_are_rows: bool
    rows_in_place: bool
    values_need_view: bool
    scales_need_view: bool
    launch: BoundLaunch  # the launches of this structure (variant from the kernel's rules)


_QUANTIZE_PLANS = CallCache()


# Decode-sized batches quantize in more, smaller programs (engram.tuning, wkv.quantize_*). H200, whole FP8
# layer at T = 64 graph-replayed (benchmarks/NOTES.md, "Small T: launch shapes"): (8, 2) 66.8 us against
# 68.9 for (32, 4), the quantize alone 7.4 against 8.8 us; larger T keep (32, 4) (bench_layer.py). Every
# shape gives the same bytes.
SMALL_T_QUANTIZE_MAX_TOKENS = _TUNED.quantize_small_max_tokens
_QUANTIZE_SMALL = (_TUNED.quantize_small.block_t, _TUNED.quantize_small.num_warps)
_QUANTIZE_LARGE = (_TUNED.quantize_large.block_t, _TUNED.quantize_large.num_warps)


def quantize_launch_shape(tokens: int) -> tuple[int, int]:
    """``(BLOCK_T, num_warps)`` of ``gather_quantize_kernel`` for ``T`` tokens (tokens x 128 values per
    program): the device kind's small shape up to ``SMALL_T_QUANTIZE_MAX_TOKENS``, its large one beyond
    (the H200's: 8 tokens with 2 warps, 32 with 4); 16 tokens and 4 warps under the interpreter."""
    if interpreting():
        return (16, 4)
    return _QUANTIZE_SMALL if tokens <= SMALL_T_QUANTIZE_MAX_TOKENS else _QUANTIZE_LARGE


_QUANTIZE_LAUNCH: list[CompiledLaunch] = []


def new_activations(padded: int, in_features: int, groups: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Unwritten ``(a float8_e4m3fn [padded_T, K], a_scale fp32 [padded_T, groups])`` for the quantize
    to fill; ``a_scale`` column-major (strides ``(1, padded_T)``). Tests replace this to poison them."""
    a = torch.empty(padded, in_features, dtype=torch.float8_e4m3fn, device=device)
    a_scale = torch.empty_strided((padded, groups), (1, padded), dtype=torch.float32, device=device)
    return a, a_scale


def _plan_quantize(values, scales, hash_ids, row_start) -> _QuantizePlan:
    value_bytes, scale_bytes, hash_ids, tokens, columns = _check_rows_source(values, scales, hash_ids, row_start)
    head_dim = value_bytes.shape[1]
    in_features = columns * head_dim
    padded = padded_tokens(tokens)
    groups = -(-in_features // ACTIVATION_GROUP)
    block_t, num_warps = quantize_launch_shape(tokens)
    ids_are_rows = hash_ids is None
    strides = (0, 0) if ids_are_rows else (hash_ids.stride(0), hash_ids.stride(1))
    # Rows are read at r * row stride: packed rows [T, C, D] whose token stride is C row strides
    # are passed as they are (no reshape per call), others flattened on every call.
    in_place = all(t.dim() == 2 or t.stride(0) == t.shape[1] * t.stride(1) for t in (values, scales))
    ints = (tokens, padded, columns, *strides, row_start, value_bytes.shape[0],
            value_bytes.stride(0), scale_bytes.stride(0))
    device_index = values.device.index if values.is_cuda else 0
    return _QuantizePlan(padded, in_features, groups, (max(1, triton.cdiv(tokens, block_t)), groups), ints,
                         (head_dim, block_t, ids_are_rows), num_warps, ids_are_rows, in_place,
                         values.dtype != torch.uint8, scales.dtype != torch.uint8,
                         _quantize_launch().bind(num_warps, device_index))


def quantize_gathered_rows(
    values: torch.Tensor,
    scales: torch.Tensor,
    hash_ids: torch.Tensor | None,
    row_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows -> E4M3 activations with power-of-two 1 x 128 scales (see ``gather_quantize_kernel``).

    Args:
        values, scales: table rows ``[R, D]`` / ``[R, D / 32]`` read by ``hash_ids`` (rows
            ``[row_start, row_start + R)``, ids outside read zeros), or with ``hash_ids`` None
            packed rows ``[T, C, D]`` / ``[T, C, D / 32]``. E4M3 (or its bytes) and UE8M0 bytes.
        hash_ids: int32/int64 ``[T, C]`` (the served columns, any strides), or None.

    Returns:
        ``(a float8_e4m3fn [padded_T, C * D], a_scale fp32 [padded_T, ceil(C * D / 128)])``:
        ``a_scale`` is the column-major view (strides ``(1, padded_T)``) that ``torch._scaled_mm``
        takes; rows ``>= T`` are zeros with scale 1 (``padded_T`` = :func:`padded_tokens`).
        Checks and launch shape are worked out once per argument structure.
    """
    key = (structure(values), structure(scales), structure(hash_ids), type(row_start), row_start)
    plan = _QUANTIZE_PLANS.get(key)
    if plan is None:
        plan = _QUANTIZE_PLANS.put(key, _plan_quantize(values, scales, hash_ids, row_start))
    device = values.device
    a, a_scale = new_activations(plan.padded, plan.in_features, plan.groups, device)
    if plan.in_features == 0:
        return a, a_scale
    if not plan.rows_in_place:
        values, scales = values.flatten(0, 1), scales.flatten(0, 1)
    value_bytes = values.view(torch.uint8) if plan.values_need_view else values
    scale_bytes = scales.view(torch.uint8) if plan.scales_need_view else scales
    ids = value_bytes if plan.ids_are_rows else hash_ids  # any pointer when unused
    with _on_device(value_bytes):
        plan.launch(plan.grid, (ids, value_bytes, scale_bytes, a, a_scale, *plan.ints, *plan.constexprs))
    return a, a_scale


def _quantize_launch() -> CompiledLaunch:
    if not _QUANTIZE_LAUNCH:
        _QUANTIZE_LAUNCH.append(CompiledLaunch(gather_quantize_kernel))
    return _QUANTIZE_LAUNCH[0]


class PreparedQuantize:
    """:func:`quantize_gathered_rows` of a table's rows (``values`` / ``scales [R, ...]``) read by
    ids of one structure, checked and planned once: ``prepared(hash_ids) -> (a, a_scale)``, two
    allocations and the plan's bound launch per call (it reads the pointers' alignment, the
    kernel's only per-call variant choice). ``hash_ids`` must have the structure it was prepared with."""

    __slots__ = ("_plan", "_value_bytes", "_scale_bytes", "_row_start", "_device", "_device_index", "_scalars")

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, hash_ids: torch.Tensor, row_start: int = 0):
        plan = _plan_quantize(values, scales, hash_ids, row_start)
        if plan.ids_are_rows or not plan.rows_in_place:
            raise ValueError("PreparedQuantize reads table rows [R, D] by hash_ids")
        self._plan, self._row_start = plan, row_start
        self._value_bytes = values.view(torch.uint8) if plan.values_need_view else values
        self._scale_bytes = scales.view(torch.uint8) if plan.scales_need_view else scales
        self._device = values.device
        self._device_index = values.device.index if values.is_cuda else None
        self._scalars = (*plan.ints, *plan.constexprs)

    def __call__(self, hash_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan
        if (not plan.in_features or self._device_index is not None
                and self._device_index != torch.cuda.current_device()):
            return quantize_gathered_rows(self._value_bytes, self._scale_bytes, hash_ids, self._row_start)
        a, a_scale = new_activations(plan.padded, plan.in_features, plan.groups, self._device)
        plan.launch(plan.grid, (hash_ids, self._value_bytes, self._scale_bytes, a, a_scale, *self._scalars))
        return a, a_scale


def _weight_launch_args(weight, weight_scale, block_size, config):
    block_n_w, block_k_w = block_size
    return dict(BLOCK_N_W=block_n_w, BLOCK_K_W=block_k_w, SCALE_PER_TILE=block_n_w % config.block_n == 0)


def _grid(tokens, out_features, config):
    return (triton.cdiv(tokens, config.block_m) * triton.cdiv(out_features, config.block_n),)


def block_scaled_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    tokens: int,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: tuple[int, int],
    *,
    out: torch.Tensor | None = None,
    config: WkvGemmConfig | None = None,
) -> torch.Tensor:
    """Triton block-scaled FP8 GEMM: ``kv bf16 [T, N]`` from :func:`quantize_gathered_rows`'s
    ``(a, a_scale)`` (first ``tokens`` rows) and ``weight`` E4M3 ``[N, K]`` with fp32
    ``weight_scale [ceil(N / bn), >= ceil(K / bk)]`` (``block_size = (bn, bk)``, ``bk % 128 == 0``).
    Numerics: ``block_scaled_gemm_kernel``."""
    padded, in_features = _check_activations(a, a_scale, tokens)
    _check_weight(weight, weight_scale, block_size, in_features, ACTIVATION_GROUP)
    config = default_gemm_config(tokens, fused=False) if config is None else config
    out_features = weight.shape[0]
    out = _kv_out(out, tokens, out_features, a.device)
    if tokens == 0 or out_features == 0:
        return out
    with _on_device(a):
        block_scaled_gemm_kernel[_grid(tokens, out_features, config)](
            a.view(torch.uint8), a_scale, weight.view(torch.uint8), weight_scale, out,
            tokens, padded, in_features, out_features, weight_scale.stride(0),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP_M=config.group_m,
            **_weight_launch_args(weight, weight_scale, block_size, config),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out


def _split_k_buffer(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """fp32 scratch of :func:`small_m_gemm`'s split-K sums (uninitialized; tests poison it)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def small_m_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    tokens: int,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: tuple[int, int],
    *,
    out: torch.Tensor | None = None,
    config: SmallMGemmConfig | None = None,
) -> torch.Tensor:
    """:func:`block_scaled_gemm` for few tokens (``T <= SMALL_M_MAX_TOKENS``; larger ``T`` works
    but reads the weight once per 128 rows): same arguments, same ``kv bf16 [T, N]``.

    The K range is cut into ``config.split_k`` slices of whole 128-groups, each program streams a
    ``block_n x K / split_k`` slice of the weight (``small_m_gemm_kernel``). Splits are added
    without any program waiting on another: one split writes bf16 directly; ``"partials"``
    writes fp32 ``[splits, T, N]`` and :func:`split_k_reduce_kernel` adds them in split order
    (deterministic; ``splits * T * N * 8`` extra bytes); ``"atomic"`` adds fp32 atomically
    into a zeroed ``[T, N]`` buffer that a second launch casts (one more launch, the memset;
    the adds' order, hence the last bits, vary from run to run). Numerics otherwise those of
    ``block_scaled_gemm_kernel``: ``torch._scaled_mm``'s up to fp32 summation order.
    """
    padded, in_features = _check_activations(a, a_scale, tokens)
    _check_weight(weight, weight_scale, block_size, in_features, ACTIVATION_GROUP)
    config = default_small_m_config(tokens) if config is None else config
    out_features = weight.shape[0]
    out = _kv_out(out, tokens, out_features, a.device)
    if tokens == 0 or out_features == 0:
        return out
    if in_features == 0:
        return out.zero_()
    groups = -(-in_features // ACTIVATION_GROUP)
    groups_per_split = -(-groups // config.split_k)
    splits = -(-groups // groups_per_split)
    block_m = small_m_block_m(tokens)
    block_n_w, block_k_w = block_size
    if splits == 1:
        output, target = "bf16", out
    elif config.reduction == "partials":
        output, target = "partials", _split_k_buffer((splits, tokens, out_features), a.device)
    else:
        output, target = "atomic", _split_k_buffer((tokens, out_features), a.device).zero_()
    grid = (triton.cdiv(out_features, config.block_n), splits, triton.cdiv(tokens, block_m))
    with _on_device(a):
        small_m_gemm_kernel[grid](
            a.view(torch.uint8), a_scale, weight.view(torch.uint8), weight_scale, target,
            tokens, padded, in_features, out_features, weight_scale.stride(0), groups_per_split,
            BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_N_W=block_n_w, BLOCK_K_W=block_k_w,
            SCALE_PER_TILE=block_n_w % config.block_n == 0, SWAP_AB=config.swap_ab, OUTPUT=output,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if output != "bf16":
            elements = tokens * out_features
            reduce_block = 1024
            split_k_reduce_kernel[(triton.cdiv(elements, reduce_block),)](
                target, out, splits if output == "partials" else 1, elements, BLOCK=reduce_block, num_warps=4,
            )
    return out


def fused_gather_gemm(
    values: torch.Tensor,
    scales: torch.Tensor,
    hash_ids: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: tuple[int, int],
    row_start: int = 0,
    *,
    out: torch.Tensor | None = None,
    config: WkvGemmConfig | None = None,
) -> torch.Tensor:
    """Path (b): ``kv bf16 [T, N]`` straight from FP8 rows (numerics: ``fused_gather_gemm_kernel``).

    ``values``, ``scales``, ``hash_ids``, ``row_start`` as :func:`quantize_gathered_rows` (table
    rows by id, or packed rows with ``hash_ids`` None); ``weight`` / ``weight_scale`` /
    ``block_size`` as :func:`block_scaled_gemm` with ``bk % 32 == 0``."""
    value_bytes, scale_bytes, hash_ids, tokens, columns = _check_rows_source(values, scales, hash_ids, row_start)
    head_dim = value_bytes.shape[1]
    in_features = columns * head_dim
    _check_weight(weight, weight_scale, block_size, in_features, BLOCK_SIZE)
    config = default_gemm_config(tokens, fused=True) if config is None else config
    out_features = weight.shape[0]
    out = _kv_out(out, tokens, out_features, value_bytes.device)
    if tokens == 0 or out_features == 0:
        return out
    if in_features == 0:
        return out.zero_()
    ids_are_rows = hash_ids is None
    ids = value_bytes if ids_are_rows else hash_ids
    strides = (0, 0) if ids_are_rows else (hash_ids.stride(0), hash_ids.stride(1))
    with _on_device(value_bytes):
        fused_gather_gemm_kernel[_grid(tokens, out_features, config)](
            ids, value_bytes, scale_bytes, weight.view(torch.uint8), weight_scale, out,
            tokens, columns, *strides, row_start, value_bytes.shape[0], value_bytes.stride(0), scale_bytes.stride(0),
            in_features, out_features, weight_scale.stride(0),
            HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP_M=config.group_m,
            **_weight_launch_args(weight, weight_scale, block_size, config), IDS_ARE_ROWS=ids_are_rows,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out
