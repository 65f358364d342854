"""The decoder stand-in of ``bench_step.py``: one GPU's share of DeepSeek-V4.1-Flash's decoder layers
under 8-way data-parallel attention and expert parallelism, as FP8 GEMMs.

Per layer (released text_config: hidden 5120, 64 heads of 512, q_lora_rank 1280, o_lora_rank 1024 in 8
groups, 384 routed experts of 2304, 6 per token, 1 shared expert), on the GPU's own ``T`` tokens:

* attention projections: q_a 5120 -> 1280, q_b 1280 -> 64 x 512, kv 5120 -> 576, o in 8 groups
  4096 -> 1024 (one batched GEMM), o_b 8192 -> 5120;
* the shared expert: 5120 -> 2 x 2304, 2304 -> 5120;
* the 48 local routed experts (384 / 8), same shapes, ``6 T`` token-expert pairs spread evenly over
  them, as one grouped GEMM per projection (``torch._scaled_grouped_mm``; a loop of GEMMs where that
  fails, see :func:`choose_forms`).

GEMMs are ``torch._scaled_mm`` with rowwise fp32 scales (FP8 E4M3 operands, bf16 out); where this
build has no ``torch._scaled_mm`` for the device (:func:`fp8_gemm_available`), plain bf16 ``torch.mm``.
Between them only what the data flow needs: before each sub-layer the hyper-connection mix of the
residual ``h [T, hc, hidden]`` (a mean over ``hc``) and an RMSNorm (the model's; it also keeps the
E4M3 casts in range: unnormalized, the gate * up products grow quadratically layer after layer and
overflow to NaN), FP8 casts of the activations, the gate * up product of the experts, the dispatch
copy of the routed rows, the sum over a token's 6 experts, and the residual update (an add).

Left out: the attention core (and its KV cache) and the all-to-all of expert parallelism. Both make a
real step longer, so Engram's share of this stand-in's step is an upper bound.

One layer's weights (1.7 GB of FP8 at V4.1 shapes, far beyond the 60 MB L2) serve every layer.
Values stay in range: weights N(0, 1 / K) (E4M3 bytes of N(0, 16^2), scale 1 / (16 sqrt K)), normalized
activations ~N(0, 1), residual updates added at half weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class DecoderShape:
    """One GPU's share of a decoder layer (see the module docstring)."""

    layers: int
    hidden: int
    hc: int
    heads: int
    head_dim: int
    q_lora: int
    kv_latent: int
    o_groups: int
    o_lora: int
    local_experts: int
    expert_dim: int
    top_k: int

    @property
    def o_group_in(self) -> int:
        return self.heads * self.head_dim // self.o_groups


V41_FLASH = DecoderShape(layers=40, hidden=5120, hc=4, heads=64, head_dim=512, q_lora=1280, kv_latent=576,
                         o_groups=8, o_lora=1024, local_experts=48, expert_dim=2304, top_k=6)
SMOKE = DecoderShape(layers=4, hidden=128, hc=4, heads=4, head_dim=32, q_lora=64, kv_latent=32, o_groups=2,
                     o_lora=32, local_experts=4, expert_dim=64, top_k=6)


@dataclass
class Weight:
    """``w [.., N, K]`` (E4M3, or bf16 without FP8) and its fp32 output-channel scales ``[1, N]`` or
    ``[G, N]`` (None for bf16). ``t``: ``w`` transposed, the column-major ``[.., K, N]`` operand."""

    w: torch.Tensor
    scale: torch.Tensor | None

    @property
    def t(self) -> torch.Tensor:
        return self.w.transpose(-2, -1)

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def dense(self) -> torch.Tensor:
        """fp32 ``[.., N, K]``: what the GEMM multiplies by (a reference for the checks)."""
        dense = self.w.float()
        return dense if self.scale is None else dense * self.scale.reshape(*self.w.shape[:-1], 1)


def make_weight(shape: tuple[int, ...], fp8: bool, generator: torch.Generator, device) -> Weight:
    """Random ``shape = (.., N, K)`` weight, N(0, 1 / K) in effect; made one ``[N, K]`` slice at a time."""
    *lead, n, k = shape
    w = torch.empty(shape, dtype=FP8 if fp8 else torch.bfloat16, device=device)
    flat = w.view(-1, n, k)
    for index in range(flat.shape[0]):
        random = torch.randn(n, k, device=device, generator=generator)
        flat[index] = (random * 16).to(FP8) if fp8 else (random / math.sqrt(k)).to(torch.bfloat16)
    scale = None
    if fp8:
        scale = torch.full((*(lead or [1]), n), 1 / (16 * math.sqrt(k)), dtype=torch.float32, device=device)
    return Weight(w, scale)


@dataclass
class RoutingPlan:
    """``T`` tokens' ``pairs = top_k * T`` token-expert rows, laid out expert after expert: ``counts``
    rows per local expert (host ints, spread evenly), ``offs`` their int32 cumulative ends (device),
    ``route`` the token of each row (int64, device)."""

    tokens: int
    counts: list[int]
    offs: torch.Tensor
    route: torch.Tensor

    @property
    def pairs(self) -> int:
        return sum(self.counts)


def routing_plan(shape: DecoderShape, tokens: int, device) -> RoutingPlan:
    pairs = shape.top_k * tokens
    base, extra = divmod(pairs, shape.local_experts)
    counts = [base + (1 if expert < extra else 0) for expert in range(shape.local_experts)]
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    route = torch.arange(pairs, device=device) // shape.top_k
    return RoutingPlan(tokens, counts, offs, route)


class Gemms:
    """The stand-in's GEMMs. ``fp8``: ``torch._scaled_mm`` (rowwise scales) else bf16 ``torch.mm``;
    ``expert_form``: ``"grouped"`` (``torch._scaled_grouped_mm``) or ``"loop"``; ``o_form``:
    ``"grouped"`` (batched over a strided view), ``"grouped_copy"`` (over a contiguous copy) or ``"loop"``."""

    def __init__(self, fp8: bool):
        self.fp8 = fp8
        self.expert_form = "grouped" if fp8 else "loop"
        self.o_form = "grouped" if fp8 else "loop"
        self._ones: dict[tuple, torch.Tensor] = {}

    def ones(self, shape: tuple[int, ...], device) -> torch.Tensor:
        """fp32 activation scales of 1 (the casts below put activations in E4M3's range unscaled)."""
        key = (shape, str(device))
        if key not in self._ones:
            self._ones[key] = torch.ones(shape, dtype=torch.float32, device=device)
        return self._ones[key]

    def cast(self, x: torch.Tensor) -> torch.Tensor:
        """A GEMM operand (E4M3, or ``x`` itself without FP8), contiguous."""
        return x.to(FP8, memory_format=torch.contiguous_format) if self.fp8 else x.contiguous()

    def linear(self, a: torch.Tensor, weight: Weight) -> torch.Tensor:
        """``a [M, K] @ w.T`` -> bf16 ``[M, N]``."""
        if not self.fp8:
            return a @ weight.t
        return torch._scaled_mm(a, weight.t, scale_a=self.ones((a.shape[0], 1), a.device), scale_b=weight.scale,
                                out_dtype=torch.bfloat16)

    def _slice(self, a: torch.Tensor, weight: Weight, index: int) -> torch.Tensor:
        scale = None if weight.scale is None else weight.scale[index:index + 1]
        return self.linear(a, Weight(weight.w[index], scale))

    def experts(self, a: torch.Tensor, weight: Weight, plan: RoutingPlan) -> torch.Tensor:
        """Rows ``a [pairs, K]`` (expert after expert, ``plan.counts``) times their expert's ``w [G, N, K]``
        -> bf16 ``[pairs, N]``."""
        if self.expert_form == "grouped":
            return torch._scaled_grouped_mm(a, weight.t, self.ones((a.shape[0],), a.device), weight.scale,
                                            offs=plan.offs, out_dtype=torch.bfloat16)
        pieces, first = [], 0
        for expert, count in enumerate(plan.counts):
            if count:
                pieces.append(self._slice(a[first:first + count], weight, expert))
            first += count
        return torch.cat(pieces)

    def grouped_o(self, a: torch.Tensor, weight: Weight) -> torch.Tensor:
        """``a [T, G * K]`` (group ``g`` = columns ``[g K, (g + 1) K)``) times ``w [G, N, K]`` -> the next
        GEMM's operand ``[T, G * N]`` (cast)."""
        groups, n, k = weight.w.shape
        tokens = a.shape[0]
        if self.o_form == "loop":
            pieces = [self._slice(a[:, g * k:(g + 1) * k].contiguous(), weight, g) for g in range(groups)]
            return self.cast(torch.cat(pieces, dim=1))
        batched = a.view(tokens, groups, k).transpose(0, 1)  # [G, T, K], row-major in its last two dims
        if self.o_form == "grouped_copy":
            batched = batched.contiguous()
        out = torch._scaled_grouped_mm(batched, weight.t, self.ones((groups, tokens), a.device), weight.scale,
                                       out_dtype=torch.bfloat16)  # [G, T, N]
        return self.cast(out.transpose(0, 1)).view(tokens, groups * n)


class Decoder:
    """One layer's weights (serving every layer) and the layer's forward; ``layer`` is pure (returns a
    new ``h``), so graph replays and repeated calls see the same inputs."""

    def __init__(self, shape: DecoderShape, gemms: Gemms, generator: torch.Generator, device):
        self.shape, self.gemms, self.device = shape, gemms, device
        s, fp8 = shape, gemms.fp8

        def weight(*dims):
            return make_weight(dims, fp8, generator, device)

        self.q_a = weight(s.q_lora, s.hidden)
        self.q_b = weight(s.heads * s.head_dim, s.q_lora)
        self.kv = weight(s.kv_latent, s.hidden)
        self.o_a = weight(s.o_groups, s.o_lora, s.o_group_in)
        self.o_b = weight(s.hidden, s.o_groups * s.o_lora)
        self.shared_up = weight(2 * s.expert_dim, s.hidden)
        self.shared_down = weight(s.hidden, s.expert_dim)
        self.experts_up = weight(s.local_experts, 2 * s.expert_dim, s.hidden)
        self.experts_down = weight(s.local_experts, s.hidden, s.expert_dim)

    @property
    def weights(self) -> dict[str, Weight]:
        return {name: getattr(self, name) for name in ("q_a", "q_b", "kv", "o_a", "o_b", "shared_up", "shared_down",
                                                       "experts_up", "experts_down")}

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        """The sub-layer input: ``h [T, hc, hidden]`` mixed over ``hc``, RMS-normalized (bf16 ``[T, hidden]``)."""
        return torch.nn.functional.rms_norm(h.mean(dim=1), (self.shape.hidden,), eps=1e-6)

    def layer(self, h: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        """``h`` bf16 ``[T, hc, hidden]`` -> the next layer's ``h``."""
        g, e = self.gemms, self.shape.expert_dim
        x8 = g.cast(self._norm(h))
        q = g.linear(g.cast(g.linear(x8, self.q_a)), self.q_b)  # queries: what the attention core would read
        g.linear(x8, self.kv)                                   # the KV latent the attention core would cache
        attention = g.linear(g.grouped_o(g.cast(q), self.o_a), self.o_b)
        h = torch.add(h, attention.unsqueeze(1), alpha=0.5)
        y8 = g.cast(self._norm(h))
        shared = g.linear(y8, self.shared_up)
        shared = g.linear(g.cast(shared[:, :e] * shared[:, e:]), self.shared_down)
        routed_in = (y8.view(torch.uint8).index_select(0, plan.route).view(y8.dtype) if g.fp8
                     else y8.index_select(0, plan.route))
        routed = g.experts(routed_in, self.experts_up, plan)
        routed = g.experts(g.cast(routed[:, :e] * routed[:, e:]), self.experts_down, plan)
        ffn = routed.view(plan.tokens, self.shape.top_k, -1).sum(dim=1) + shared
        return torch.add(h, ffn.unsqueeze(1), alpha=0.5)

    def flops(self, tokens: int) -> int:
        """Multiply-adds x 2 of one layer's GEMMs at ``tokens`` tokens."""
        s = self.shape
        per_token = (s.hidden * s.q_lora + s.q_lora * s.heads * s.head_dim + s.hidden * s.kv_latent
                     + s.heads * s.head_dim * s.o_lora + s.o_groups * s.o_lora * s.hidden
                     + (1 + s.top_k) * (s.hidden * 2 * s.expert_dim + s.expert_dim * s.hidden))
        return 2 * tokens * per_token


def fp8_gemm_available(device) -> bool:
    """Whether ``torch._scaled_mm`` (rowwise scales) runs on ``device`` (CUDA; recent CPU builds too)."""
    try:
        a = torch.ones(16, 32, device=device).to(FP8)
        out = torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                               scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
        return bool(out.float().eq(32).all())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _relative_error(found: torch.Tensor, reference: torch.Tensor) -> float:
    return float((found.float() - reference).norm() / reference.norm().clamp_min(1e-30))


def choose_forms(decoder: Decoder, generator: torch.Generator, tolerance: float = 2e-2) -> dict:
    """Check each FP8 GEMM form against an fp32 reference (fresh random operands) and keep the first
    that runs and matches: the grouped expert GEMM (else a loop of GEMMs) at 6 pairs (most experts
    empty) and at 8 per expert, the batched o GEMM (strided, else on a copy, else a loop).
    Returns what was chosen and why. Without FP8 nothing is checked (bf16 ``torch.mm``, loops)."""
    gemms, shape, device = decoder.gemms, decoder.shape, decoder.device
    notes: dict = {"fp8": gemms.fp8, "expert_form": gemms.expert_form, "o_form": gemms.o_form, "errors": []}
    if not gemms.fp8:
        notes["note"] = "no torch._scaled_mm here: bf16 torch.mm GEMMs, expert and o GEMMs as loops"
        return notes

    def operand(rows, k):
        return gemms.cast(torch.randn(rows, k, device=device, generator=generator))

    worst = 0.0
    for rows in (1, 37):
        a = operand(rows, shape.hidden)
        worst = max(worst, _relative_error(gemms.linear(a, decoder.q_a), a.float() @ decoder.q_a.dense().T))
    notes["linear_rel_error"] = worst
    if worst > tolerance:
        raise RuntimeError(f"torch._scaled_mm (rowwise) differs from fp32 by {worst:.3g}")

    def expert_dense(x):
        up = decoder.experts_up
        return Weight(up.w[x], None if up.scale is None else up.scale[x:x + 1]).dense()

    for form in ("grouped", "loop"):
        gemms.expert_form = form
        try:
            worst = 0.0
            for tokens in (1, 64):
                plan = routing_plan(shape, tokens, device)
                rows = operand(plan.pairs, shape.hidden)
                found = gemms.experts(rows, decoder.experts_up, plan)
                _sync(found)
                bounds = [0] + torch.tensor(plan.counts).cumsum(0).tolist()
                reference = torch.cat([rows[bounds[x]:bounds[x + 1]].float() @ expert_dense(x).T
                                       for x in range(shape.local_experts) if plan.counts[x]])
                worst = max(worst, _relative_error(found, reference))
            if worst <= tolerance:
                notes["expert_form"], notes["expert_rel_error"] = form, worst
                break
            notes["errors"].append(f"experts {form}: relative error {worst:.3g}")
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as error:
            notes["errors"].append(f"experts {form}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    else:
        raise RuntimeError(f"no expert GEMM form works: {notes['errors']}")

    dense_o = decoder.o_a.dense()
    for form in ("grouped", "grouped_copy", "loop"):
        gemms.o_form = form
        try:
            a = operand(37, shape.heads * shape.head_dim)
            found = gemms.grouped_o(a, decoder.o_a).float()
            _sync(found)
            k = shape.o_group_in
            reference = torch.cat([a[:, g * k:(g + 1) * k].float() @ dense_o[g].T for g in range(shape.o_groups)],
                                  dim=1)
            error = _relative_error(found, reference)  # includes the cast of the output to E4M3
            if error <= 0.1:
                notes["o_form"], notes["o_rel_error"] = form, error
                break
            notes["errors"].append(f"o {form}: relative error {error:.3g}")
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as error:
            notes["errors"].append(f"o {form}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    else:
        raise RuntimeError(f"no o GEMM form works: {notes['errors']}")
    return notes
