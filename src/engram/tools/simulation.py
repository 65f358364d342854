"""A small engine that streams requests through :class:`NgramHasher` as a serving
engine would: several requests per batch, chunked prefill in uneven chunks,
decode steps with speculative drafts, a paged KV cache with shuffled and
prefix-shared blocks, preemption. Used by the demo and by the property tests;
every hashed token is checked against the whole-sequence reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engram.checks import check_int
from engram.hashing.batch import NgramHasher
from engram.hashing.reference import hash_ngrams

__all__ = ["Request", "StreamingEngine", "HISTORY_SOURCES"]

HISTORY_SOURCES = ("slot_cache", "request_history", "lookback")


@dataclass
class Request:
    """One sequence: raw token ids and dead flags, and how far the engine got."""

    name: str
    token_ids: np.ndarray
    dead: np.ndarray
    computed: int = 0            # positions [0, computed) are hashed and accepted
    blocks: list[int] = field(default_factory=list)
    reference: np.ndarray | None = None  # [T, L, C] from hash_ngrams

    @property
    def done(self) -> bool:
        return self.computed >= len(self.token_ids)


class StreamingEngine:
    """Drive ``hasher`` step by step and check every accepted token's ids.

    ``source`` picks where history before a chunk comes from: the bound slot
    cache (paged, block ids drawn in random order), the per-request history
    (rows named by request), or lookback windows built from the true sequence.
    """

    def __init__(self, hasher: NgramHasher, source: str, rng: np.random.Generator, *,
                 block_size: int = 16, num_blocks: int = 256, max_requests: int = 64, max_draft_tokens: int = 4,
                 fused_slot_write: bool = False):
        if source not in HISTORY_SOURCES:
            raise ValueError(f"source: expected one of {HISTORY_SOURCES}, found {source!r}")
        self.hasher = hasher
        self.source = source
        self.rng = rng
        self.block_size = block_size
        self.max_draft_tokens = max_draft_tokens
        self.history = hasher.history_length
        if source == "slot_cache":
            hasher.bind_slot_cache(num_blocks * block_size, block_size, fused_write=fused_slot_write)
            self.free_blocks = list(rng.permutation(num_blocks))
        elif source == "request_history":
            hasher.bind_request_history(max_requests, max_draft_tokens=max_draft_tokens)
        self.requests: dict[str, Request] = {}
        self.tokens_checked = 0
        self.mismatches = 0
        self.tokens_hashed = 0
        self.steps = 0
        self.hash_seconds = 0.0

    # ---- requests ------------------------------------------------------------
    def add(self, name: str, token_ids, dead=None, *, share_prefix_with: str | None = None) -> Request:
        """Add a request; with ``share_prefix_with`` (slot cache only) it reuses the other
        request's full blocks of a common, already computed prefix (a prefix-cache hit)."""
        if name in self.requests:
            raise ValueError(f"name: a request named {name!r} is already running; expected a new name")
        token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if token_ids.size == 0:
            raise ValueError(f"token_ids: request {name!r} has no tokens; expected at least one")
        dead = np.zeros(len(token_ids), dtype=bool) if dead is None else np.asarray(dead, dtype=bool)
        request = Request(name, token_ids, dead)
        request.reference = hash_ngrams(token_ids, self.hasher.layout, self.hasher.vocab, dead)
        if share_prefix_with is not None and self.source == "slot_cache":
            donor = self.requests[share_prefix_with]
            common = 0
            limit = min(donor.computed, len(token_ids) - 1)
            while (common < limit and donor.token_ids[common] == token_ids[common]
                   and donor.dead[common] == dead[common]):
                common += 1
            full_blocks = common // self.block_size
            request.blocks = list(donor.blocks[:full_blocks])
            request.computed = full_blocks * self.block_size
        self.requests[name] = request
        return request

    def finish(self, name: str) -> None:
        request = self.requests.pop(name)
        if self.source == "request_history":
            self.hasher.release_requests([name])
        # Blocks are not returned to the free list: another request may share them.
        del request

    # ---- one step ------------------------------------------------------------
    def step(self, plan: list[tuple[str, int, int, int]]) -> None:
        """Run one batch. ``plan`` entries: (request name, true tokens to feed,
        draft tokens appended, drafts accepted among them).

        Drafts: the first ``accepted`` are the true next tokens, the rest are wrong;
        the request then advances by ``tokens + accepted``.
        """
        input_ids, positions, dead, starts, slot_mapping, tables, lookbacks, lookback_dead = [], [], [], [0], [], [], [], []
        checks = []
        vocab_size = self.hasher.vocab.vocab_size
        for name, num_true, num_drafts, accepted in plan:
            request = self.requests[name]
            first = request.computed
            fed = min(num_true + accepted, len(request.token_ids) - first)
            ids = list(request.token_ids[first:first + fed])
            flags = list(request.dead[first:first + fed])
            for _ in range(max(0, num_drafts - accepted)):  # wrong drafts: a token that differs
                true_next = request.token_ids[first + len(ids)] if first + len(ids) < len(request.token_ids) else 0
                ids.append(int((true_next + 1 + self.rng.integers(vocab_size - 1)) % vocab_size))
                flags.append(False)
            count = len(ids)
            input_ids += ids
            dead += flags
            positions += list(range(first, first + count))
            checks.append((request, len(input_ids) - count, first, fed))
            starts.append(len(input_ids))
            if self.source == "slot_cache":
                self._ensure_blocks(request, first + count)
                slot_mapping += [request.blocks[p // self.block_size] * self.block_size + p % self.block_size
                                 for p in range(first, first + count)]
                tables.append(request.blocks)
            lookback = [int(request.token_ids[first - 1 - j]) if first - 1 - j >= 0 else -1 for j in range(self.history)]
            lookbacks.append(lookback)
            lookback_dead.append([bool(request.dead[first - 1 - j]) if first - 1 - j >= 0 else False
                                  for j in range(self.history)])

        device = self.hasher.device
        kwargs = {}
        if self.source == "slot_cache":
            width = max(len(t) for t in tables)
            table = np.zeros((len(tables), width), dtype=np.int32)
            for k, blocks in enumerate(tables):
                table[k, :len(blocks)] = blocks
            kwargs.update(slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
                          block_table=torch.from_numpy(table).to(device))
        elif self.source == "request_history":
            kwargs.update(request_rows=self.hasher.request_rows([name for name, *_ in plan]))
        else:
            kwargs.update(lookback_token_ids=torch.tensor(lookbacks, dtype=torch.int64, device=device),
                          lookback_dead_mask=torch.tensor(lookback_dead, dtype=torch.bool, device=device))
        started = time.perf_counter()
        result = self.hasher(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device),
            dead_mask=torch.tensor(dead, dtype=torch.bool, device=device),
            **kwargs,
        ).cpu().numpy()
        self.hash_seconds += time.perf_counter() - started
        self.tokens_hashed += len(input_ids)
        self.steps += 1
        for request, batch_start, first, fed in checks:
            got = result[batch_start:batch_start + fed]
            expected = request.reference[first:first + fed]
            self.tokens_checked += fed
            self.mismatches += int((got != expected).any(axis=(1, 2)).sum())
            request.computed = first + fed

    def _step_advancing(self, plan: list[tuple[str, int, int, int]]) -> None:
        """:meth:`step`, and an error if no request advanced (every loop over steps is bounded)."""
        before = sum(r.computed for r in self.requests.values())
        self.step(plan)
        if sum(r.computed for r in self.requests.values()) == before:
            raise RuntimeError(f"a step advanced no request (plan {plan}); the schedule would never end")

    def _ensure_blocks(self, request: Request, length: int) -> None:
        while len(request.blocks) * self.block_size < length:
            if not self.free_blocks:
                raise RuntimeError("the simulated KV cache ran out of blocks; bind more")
            request.blocks.append(int(self.free_blocks.pop()))

    # ---- a whole random schedule ---------------------------------------------
    def run_random(self, max_batch_tokens: int = 64, draft_probability: float = 0.3,
                   pause_probability: float = 0.2) -> None:
        """Serve every request to the end: uneven prefill chunks while a request has many
        tokens left, then decode steps (one token plus drafts); requests are paused
        (preempted) at random for a step."""
        check_int("max_batch_tokens", max_batch_tokens, 1)
        while any(not r.done for r in self.requests.values()):
            plan, budget = [], max_batch_tokens
            active = [r for r in self.requests.values() if not r.done]
            order = self.rng.permutation(len(active))
            paused = self.rng.random(len(active)) < pause_probability
            paused[order[0]] = False  # one request runs every step
            for index in order:
                request = active[index]
                if paused[index]:
                    continue  # preempted this step; its history must survive
                left = len(request.token_ids) - request.computed
                if budget <= 0:
                    break
                if left > 4 and self.rng.random() < 0.6:  # prefill chunk
                    size = int(self.rng.integers(1, min(left, budget) + 1))
                    plan.append((request.name, size, 0, 0))
                    budget -= size
                else:  # decode step, maybe with drafts
                    drafts = int(self.rng.integers(1, self.max_draft_tokens + 1)) if self.rng.random() < draft_probability else 0
                    accepted = int(self.rng.integers(0, drafts + 1)) if drafts else 0
                    plan.append((request.name, 1, drafts, accepted))
                    budget -= 1 + drafts
            self._step_advancing(plan)

    def run_prefill_then_decode(self, prompt_fraction: float = 0.8, chunk_sizes: tuple[int, int] = (17, 400),
                                max_batch_tokens: int = 1024, max_decode_steps: int | None = None) -> None:
        """As an engine serves prompts: every request is prefilled in uneven chunks up to
        ``prompt_fraction`` of its tokens (several requests per batch), then the rest is
        decoded one token per step, all running requests in one batch."""
        check_int("max_batch_tokens", max_batch_tokens, 1)
        if len(chunk_sizes) != 2 or not 1 <= chunk_sizes[0] <= chunk_sizes[1]:
            raise ValueError(f"chunk_sizes: expected (smallest, largest) with 1 <= smallest <= largest, found {chunk_sizes!r}")
        prompt_end = {name: min(len(r.token_ids), max(1, int(len(r.token_ids) * prompt_fraction)))
                      for name, r in self.requests.items()}
        while True:
            plan, budget = [], max_batch_tokens
            for name, request in self.requests.items():
                left = prompt_end[name] - request.computed
                if left > 0 and budget > 0:
                    size = min(left, budget, int(self.rng.integers(chunk_sizes[0], chunk_sizes[1] + 1)))
                    plan.append((name, size, 0, 0))
                    budget -= size
            if not plan:
                break
            self._step_advancing(plan)
        steps = 0
        while any(not r.done for r in self.requests.values()):
            if max_decode_steps is not None and steps >= max_decode_steps:
                break
            self._step_advancing([(name, 1, 0, 0) for name, r in self.requests.items() if not r.done])
            steps += 1
