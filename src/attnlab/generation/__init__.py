"""Generation with attnlab's own loop over static caches (Llama-family causal LMs, swapped or converted).

- sampling.py   greedy, temperature, top-k, top-p, seeded draws
- generator.py  Generator: the model driven layer by layer over static caches; the fixed-shape decode step
- loop.py       generate(): batched left-padded prompts, EOS per row, streaming
"""
from .generator import Generator
from .loop import generate
from .sampling import check_sampling, filtered_probs, sample

__all__ = ["Generator", "generate", "check_sampling", "filtered_probs", "sample"]
