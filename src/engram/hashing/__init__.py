"""Hash ids of n-grams: whole-sequence reference, batch hasher, history stores."""

from engram.hashing.batch import NgramHasher
from engram.hashing.reference import hash_ngrams, ngram_windows
from engram.hashing.stores import DEAD, UNWRITTEN, RequestHistory, SlotCache

__all__ = ["NgramHasher", "hash_ngrams", "ngram_windows", "SlotCache", "RequestHistory", "DEAD", "UNWRITTEN"]
