"""A seeded bijection of ``range(n)`` computed on the fly: a Feistel network with cycle-walking.

``FeistelPermutation(n, seed)(positions)`` maps positions (a uint64 array) to shuffled indices in
O(len(positions)) time and memory, whatever ``n`` is, so an elastic sampler can re-shuffle and
repartition an epoch of 10^9 samples in O(1) (Black and Rogaway, "Ciphers with arbitrary finite
domains", CT-RSA 2002: a balanced Feistel network over the next even power of two, walked until
the value falls below ``n``; each walk takes < 4 rounds on average since the domain is < 4n).

For small domains mapped in large parts (an epoch of a small dataset: a few thousand samples)
the numpy calls' fixed cost dominates: the longest cycle walk of a call takes ~15 passes of
~70 calls each.  There the whole domain is encrypted once (:data:`TABLE_MAX_DOMAIN`) and the
walks follow that table, which gives the same values in ~4 calls a pass.
"""
from __future__ import annotations

import numpy as np

_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15
TABLE_MAX_DOMAIN = 1 << 16
"""Largest domain (values; 8 bytes each) whose encryption is tabulated once per permutation
when a call maps at least 1/8 of it."""


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """Bijection of ``range(n)`` keyed by ``seed`` (an int; e.g. hash of seed and epoch).

    Args:
        n: domain size, >= 1 (samples).
        seed: any non-negative int.

    Raises:
        ValueError: ``n`` < 1.
    """

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"permutation domain must be >= 1, got {n}")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        with np.errstate(over="ignore"):
            base = np.array([(seed * _GOLDEN + r * 0x632BE59BD9B4E019) & ((1 << 64) - 1)
                             for r in range(_ROUNDS)], dtype=np.uint64)
            self.keys = _splitmix64(base)
        self._domain = 1 << bits
        self._table = None  # the encrypted domain (uint64 array), once tabulated

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left = x >> self.half
        right = x & self.mask
        with np.errstate(over="ignore"):
            for k in self.keys:
                left, right = right, left ^ (_splitmix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Shuffled indices for ``positions`` (array of ints in [0, n)), as a uint64 array."""
        positions = np.asarray(positions, dtype=np.uint64)
        if self._table is None and self._domain <= TABLE_MAX_DOMAIN \
                and 8 * positions.size >= self._domain:
            self._table = self._encrypt(np.arange(self._domain, dtype=np.uint64))
        step = self._encrypt if self._table is None else self._table.__getitem__
        x = step(positions)
        out_of_range = x >= self.n
        while out_of_range.any():
            x[out_of_range] = step(x[out_of_range])
            out_of_range = x >= self.n
        return x
