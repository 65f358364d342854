"""Hash ids of n-grams: whole-sequence reference, batch hasher, history stores."""

from .batch import NgramHasher
from .reference import hash_ngrams, ngram_windows
from .stores import DEAD, UNWRITTEN, RequestHistory, SlotCache

__all__ = ["NgramHasher", "hash_ngrams", "ngram_windows", "SlotCache", "RequestHistory", "DEAD", "UNWRITTEN"]
