"""Plans: a layer's (and a step's) checks and choices made once for a batch structure; run() equals the
layer call bit for bit and refuses a call of another structure before launching anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engram


def _inputs(memory, rng: np.random.Generator, tokens: int):
    spec = memory.spec
    offsets = torch.as_tensor(np.asarray(memory.layout.column_offsets), dtype=torch.int64)  # [L, C]
    primes = torch.as_tensor(np.asarray(memory.layout.column_primes), dtype=torch.int64)
    local = torch.from_numpy(rng.integers(0, 2**31, (tokens, spec.num_layers, spec.num_columns)))
    hash_ids = (offsets + local % primes).to(torch.int32)
    hidden = torch.from_numpy(rng.standard_normal((tokens, spec.hc_mult, spec.hidden_size))).to(torch.bfloat16)
    mask = torch.from_numpy(rng.random(tokens) < 0.8)
    return hash_ids, hidden, mask


@pytest.mark.parametrize("tokens", [1, 7, 63])
def test_step_plan_equals_forward_layer(synthetic_model_dir, rng, tokens):
    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", progress=False)
    hash_ids, hidden, mask = _inputs(memory, rng, tokens)
    plan = memory.plan(hidden, hash_ids, mask)
    assert {p.path for p in plan.plans.values()} == {"unchecked"}  # CPU tables: no prepared launches
    for _ in range(2):  # the same plan serves later steps of the same structure
        hash_ids, hidden, mask = _inputs(memory, rng, tokens)
        for layer_id in memory.layer_ids:
            got = plan.run(layer_id, hidden, hash_ids, mask)
            expected = memory.forward_layer(layer_id, hidden, hash_ids, mask)
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_a_call_of_another_structure_is_refused(synthetic_model_dir, rng):
    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", progress=False)
    hash_ids, hidden, mask = _inputs(memory, rng, 8)
    plan = memory.plan(hidden, hash_ids, mask)
    layer_id = memory.layer_ids[0]
    other_ids, other_hidden, other_mask = _inputs(memory, rng, 9)
    with pytest.raises(ValueError, match=r"plan: hidden_states: shape \[9, .*\(the plan's \[8, "):
        plan.run(layer_id, other_hidden, other_ids, other_mask)
    with pytest.raises(ValueError, match="plan: token_mask"):
        plan.run(layer_id, hidden, hash_ids, None)          # no mask where the plan had one
    with pytest.raises(ValueError, match="plan: hidden_states: dtype"):
        plan.run(layer_id, hidden.float(), hash_ids, mask)  # another dtype


def test_plan_checks_its_arguments_once_when_made(synthetic_model_dir, rng):
    memory = engram.EngramMemory.from_pretrained(synthetic_model_dir, placement="cpu", progress=False)
    hash_ids, hidden, mask = _inputs(memory, rng, 5)
    with pytest.raises(ValueError, match=r"hidden_states: expected shape \[5, "):
        memory.plan(hidden[:4], hash_ids, mask)
    with pytest.raises(ValueError, match="token_mask: expected a torch.bool tensor"):
        memory.plan(hidden, hash_ids, mask.to(torch.uint8))
