"""CPU stand-in for upstream's KV checksum kernel (0.5.23's ``adler32_strided_checksum``, a JIT-built
GPU kernel over raw device pointers), which `--disaggregation-enable-kv-checksum` runs on both
roles and `sglang-hardened launch` turns on from 0.5.23 (H10).

Same inputs and the same digest: one Adler-32 over, for each buffer in turn, the items its index
tensor selects (``base + index * stride``, ``stride`` bytes each), in index order; 1 when nothing
is selected. Both roles run this stand-in here, so their digests agree exactly when the bytes do.
"""

import ctypes
import zlib

import torch


def adler32_strided_checksum(data_ptrs: list[int], strides: list[int], indices: list[torch.Tensor]) -> int:
    value = 1
    for base, stride, idx in zip(data_ptrs, strides, indices, strict=True):
        for item in idx.tolist():
            value = zlib.adler32(ctypes.string_at(base + item * stride, stride), value)
    return value
