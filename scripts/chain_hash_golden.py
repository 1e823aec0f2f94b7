#!/usr/bin/env python3
"""Golden chain hash for tests/unit/test_prefix_cache.cpp (ChainHashesAreStable...).

Recomputes PrefixCache::chain_hash from the byte layout documented in src/kv/prefix_cache.h
with Python's struct and the `xxhash` package (an implementation independent of the C++ one):
  u32 version | u64 parent.lo | u64 parent.hi | u64 fingerprint | u32 dtype tag
  | u64 len(ns) | ns | u32 block_size | u32 token x block_size      (little-endian)
Prints hi then lo as 32 hex digits, as PageHash::hex() does.
"""
import struct
import sys

import xxhash

VERSION = 2  # PrefixCache::kChainHashVersion


def chain_hash(parent_lo, parent_hi, tokens, fingerprint, tag, ns: bytes):
    buf = struct.pack("<IQQQI", VERSION, parent_lo, parent_hi, fingerprint, tag)
    buf += struct.pack("<Q", len(ns)) + ns + struct.pack("<I", len(tokens))
    buf += b"".join(struct.pack("<I", t & 0xFFFFFFFF) for t in tokens)
    d = xxhash.xxh3_128_intdigest(buf)
    return d >> 64, d & ((1 << 64) - 1)


if __name__ == "__main__":
    bs = 4  # kBs in the test
    hi, lo = chain_hash(0, 0, list(range(1, bs + 1)), 42, 1, b"ns")
    print(f"{hi:016x}{lo:016x}")
    sys.exit(0)
