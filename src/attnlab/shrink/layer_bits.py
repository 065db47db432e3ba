"""Bits by layer (the planner's round 5): each layer's latent and rope key coded in a step more or fewer bits than the
uniform winner's, within the same bytes, where single-layer KLs say the model is sensitive (KVTuner's idea).

Two probes of a layer alone, the others plain: V, its latent at the ladder's fewest bits b0 (the key in 8 bits), and
K, its key at the fewest key bits k0 (the latent in 7 bits); Ladder.cost models every option from them.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple  # core: plain Python, no torch

KEY_LADDER = ("c2", "c3", "c4", "r8")  # the rope key's codes, fewest bits first (modules/storage.py)
KEY_BITS = {"c2": 2, "c3": 3, "c4": 4, "r8": 8}
LATENT_BITS = (2, 7)  # the few-bit latents' range ("int2" to "int7")
PROBE_LATENT = 7  # the latent's bits while a key is measured
PROBE_KEY = "r8"  # the key's code while a latent is measured
COST_WINDOWS = 2  # of the planner's proxy windows, what each single-layer KL reads
LAYER_BITS_VARIABLE = "ATTNLAB_LAYER_BITS"  # "0" or "1": round 5 off or on, whatever the run (the protocol's variants)
_SPELLING = re.compile(r"int([2-7])/g([1-9][0-9]*)\+(c[234]|r8)((?:\+s[0-9]+)?(?:\+w[0-9]+)?)")


def planned_layer_bits() -> bool:
    """Whether the planner runs round 5: ATTNLAB_LAYER_BITS where set ("0" or "1"), else yes, with a heal or without
    (docs/decisions.md). ValueError naming the value otherwise."""
    value = os.environ.get(LAYER_BITS_VARIABLE)
    if value is None:
        return True
    if value not in ("0", "1"):
        raise ValueError(f"{LAYER_BITS_VARIABLE} must be 0 or 1, got {value!r}")
    return value == "1"


class Ladder(NamedTuple):
    """The options round 5 gives each layer for a winner's storage: latent bits and key codes around its own."""
    group: int
    latent: tuple[int, ...]
    keys: tuple[str, ...]
    rest: str  # the winner's "+s<N>+w<N>", kept by every option

    def spell(self, bits: int, key: str) -> str:
        return f"int{bits}/g{self.group}+{key}{self.rest}"

    def options(self) -> list[tuple[int, str]]:
        return [(b, k) for b in self.latent for k in self.keys]

    def value_probe(self) -> str:
        return self.spell(self.latent[0], PROBE_KEY)

    def key_probe(self) -> str:
        return self.spell(PROBE_LATENT, self.keys[0])

    # Uniform codes' squared error falls 4x a bit, and a small change's KL follows it, so
    # cost(b, k) = V 4^-(b - b0) + K 4^-(bits(k) - bits(k0)) (docs/decisions.md: the fit)
    def cost(self, value_kl: float, key_kl: float, bits: int, key: str) -> float:
        """The modelled KL of (bits, key) in a layer whose probes measured value_kl and key_kl (the comment above)."""
        return value_kl * 4.0 ** (self.latent[0] - bits) + key_kl * 4.0 ** (KEY_BITS[self.keys[0]] - KEY_BITS[key])


def ladder(storage: str | None) -> Ladder | None:
    """The Ladder of a winner's storage ("int3/g256+c4+s1+w8": latent int2-int4, key c3/c4/r8), or None for a
    storage round 5 does not step (plain, int8, llama.cpp's, a key coded with the latent)."""
    match = _SPELLING.fullmatch(storage or "")
    if match is None:
        return None
    bits, group, key, rest = int(match[1]), int(match[2]), match[3], match[4]
    lo, hi = LATENT_BITS
    latent = tuple(b for b in (bits - 1, bits, bits + 1) if lo <= b <= hi)
    at = KEY_LADDER.index(key)
    keys = KEY_LADDER[max(0, at - 1): at + 2]
    return Ladder(group, latent, keys, rest)


def bits_label(storages):
    """A per-layer plan's storages in a few words: "int2-int4 latent, c3-r8 key by layer", or the one storage every
    layer holds (a storage that is not a list: itself)."""
    if not isinstance(storages, list):
        return storages
    if len(set(storages)) == 1:
        return storages[0]
    found = [_SPELLING.fullmatch(s) for s in storages]
    bits = [f"int{b}" for b in sorted({int(m[1]) for m in found if m})]
    keys = sorted({m[3] for m in found if m}, key=KEY_LADDER.index)
    return f"{_span(bits)} latent, {_span(keys)} key by layer"


def _span(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{items[0]}-{items[-1]}"
