"""The prime bucket sizes of Engram tables (docs/design.md §2 "Primes and offsets"), from plain
integers: :mod:`engram.spec` checks row counts with them and :mod:`engram.layout` builds
offsets from them, so neither imports the other's module to get them.
"""

from __future__ import annotations

__all__ = ["is_prime", "bucket_primes"]

# Deterministic Miller-Rabin witnesses for every n < 3.3e24 (covers all int64).
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Exact primality for any non-negative int below 3.3e24."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_unused_prime(start: int, used: set[int]) -> int:
    candidate = start
    while not is_prime(candidate) or candidate in used:
        candidate += 1
    return candidate


def bucket_primes(num_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> list[list[list[int]]]:
    """Bucket sizes ``[L][N-1][H]``: per layer, order and head the next unused prime.

    The first head of each order searches upward from ``vocab_size``
    (``engram_vocab_size``, inclusive), later heads from just above the previous head's prime; a
    prime picked for any earlier (layer, order, head) is skipped.
    """
    used: set[int] = set()
    primes: list[list[list[int]]] = []
    for _layer in range(num_layers):
        layer_primes = []
        for _order in range(2, max_ngram_size + 1):
            order_primes, start = [], vocab_size
            for _head in range(n_heads):
                prime = _next_unused_prime(start, used)
                used.add(prime)
                order_primes.append(prime)
                start = prime + 1
            layer_primes.append(order_primes)
        primes.append(layer_primes)
    return primes
