"""Triton kernels, each beside its PyTorch twin (the reference and the fallback).

Importing this package does not import triton; a kernel imports it when it first
runs. mla_decode: MLA's absorbed decode in one pass over the latent cache.
"""
from .mla_decode import absorbed_decode, absorbed_decode_reference, available

__all__ = ["absorbed_decode", "absorbed_decode_reference", "available"]
