"""The malformed-metadata fuzz (tests/hash_fuzz.py) on the torch path: with validation
off, any metadata gives ids of the right shape and leaves the stores' shapes alone;
no IndexError, no hang. (The Triton kernels run the same fuzz bounds-checked under
the interpreter in test_hash_kernel.py, and under compute-sanitizer on a GPU.)"""

from __future__ import annotations

from hash_fuzz import run_fuzz
from test_hash_kernel import small_hasher


def test_torch_path_survives_malformed_metadata(seed):

    def torch_hasher(hasher_seed):
        return small_hasher(hasher_seed, device="cpu", validate=False, backend="torch")

    def check(hasher, batch, ids):
        assert ids.shape == (batch["input_ids"].shape[0], 2, 9)
        if hasher.slot_cache is not None:
            assert hasher.slot_cache.values.shape == (hasher.slot_cache.num_slots + 1,)

    assert run_fuzz(torch_hasher, seed, cases=300, after_call=check) == 300
