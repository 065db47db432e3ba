"""An orthogonal rotation of an MLA's latent, folded into its weights, so that few-bit codes see no outlier channel.

rotate_latent caches c' = R c (W_DKV' = R W_DKV, W_UK' = W_UK R^T, W_UV' = W_UV R^T): every key, value and score is
unchanged (exact in float64, to rounding in float32) and decode pays nothing. ROTATIONS (float64): "hadamard"
(Sylvester's, scaled by 1/sqrt(n), n a power of two) and "random" (Haar, from a seeded QR, any n). k_R is not rotated.
"""
from __future__ import annotations

import torch  # core module: torch only

from ..modules.rotation import hadamard as lowbit_hadamard

F64 = torch.float64
ROTATIONS = ("random", "hadamard")


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of size n (a power of two), scaled to be orthogonal, float64: the one matrix
    llama.cpp's cache rotation uses too (modules.rotation.hadamard)."""
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1 and not n & (n - 1):
        return lowbit_hadamard(n, F64)
    raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n!r}; use rotation 'random'")


def random_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """A Haar-distributed orthogonal n x n matrix (QR of a seeded Gaussian, signs fixed), float64."""
    if n < 1:
        raise ValueError(f"a rotation needs a positive size, got {n}")
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    return q * torch.sign(torch.diagonal(r))[None, :]


def rotation_matrix(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    if kind == "hadamard":
        return hadamard(n)
    if kind == "random":
        return random_orthogonal(n, seed)
    raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}, got {kind!r}")


def fold_latent(mla, T: torch.Tensor, T_inv: torch.Tensor) -> None:
    """Cache T c instead of c, for any invertible T (float64): W_DKV <- T W_DKV (its bias T b), W_UK, W_UV <- W_U T^-1;
    computed in float64 and written back in the weights' dtype. rotate_latent is the orthogonal case (T^-1 = T^T)."""
    with torch.no_grad():
        down = mla.W_DKV
        down.weight.copy_((T @ down.weight.to(F64)).to(down.weight.dtype))
        if down.bias is not None:
            down.bias.copy_((T @ down.bias.to(F64)).to(down.bias.dtype))
        for up in (mla.W_UK, mla.W_UV):
            up.weight.copy_((up.weight.to(F64) @ T_inv).to(up.weight.dtype))


# Why: an SVD latent puts most of its energy in few channels, and a few-bit code with one scale per group of channels
# spends its levels on those outliers; after a rotation each group holds values of similar size (QuaRot's and
# SpinQuant's argument for rotated KV caches, here folded into weights the conversion writes anyway). The rotary key
# k_R is left alone: RoPE turns it after W_KR, so a rotation would have to be applied to it and every query at run time.
def rotate_latent(mla, rotation="random", *, seed: int = 0):
    """Rotate `mla`'s latent in place (module docstring); returns the latent_dim x latent_dim float64 rotation applied
    (the identity on channels whose norm weight is 0).

    rotation: "random", "hadamard", or an orthogonal (r, r) tensor, r the channels rotated. A GQA tiling (kv_tiling) no
    longer holds afterwards and is dropped."""
    # A latent RMSNorm c = w * z / rms(z), z = W_DKV y: w is folded into the up-projections (W_U diag(w)) and set to 1;
    # rms(R z) = rms(z), so the norm commutes with R. Channels whose norm weight is exactly 0 (a GGUF's steady channel,
    # models/export/deepseek.py: it steadies the norm's scale, is cached as 0 and is 32 times the largest latent value)
    # stay out of R, which keeps the whole latent's norm and keeps that channel out of every block of codes.
    weight = None if mla.kv_norm is None else getattr(mla.kv_norm, "weight", None)
    moved = torch.arange(mla.latent_dim) if weight is None else torch.nonzero(weight.detach() != 0).flatten()
    r = moved.numel()  # the channels rotated: every one, or those whose norm weight is not 0
    if isinstance(rotation, torch.Tensor):
        R = rotation.to(F64)
        if R.shape != (r, r):
            raise ValueError(f"the rotation must be {r} x {r} (the latent's channels with a nonzero norm weight), "
                             f"got {tuple(R.shape)}")
        if not torch.allclose(R @ R.T, torch.eye(r, dtype=F64), atol=1e-9):
            raise ValueError("the rotation is not orthogonal (R R^T != I within 1e-9)")
    else:
        R = rotation_matrix(rotation, r, seed)
    if r < mla.latent_dim:  # the identity on the channels left out
        R = torch.eye(mla.latent_dim, dtype=F64).index_put((moved[:, None], moved[None, :]), R)
    with torch.no_grad():
        if weight is not None:
            w = weight.to(F64)
            for up in (mla.W_UK, mla.W_UV):
                up.weight.copy_((up.weight.to(F64) * w[None, :]).to(up.weight.dtype))
            weight[moved] = 1.0
    fold_latent(mla, R, R.T)
    if mla.kv_tiling is not None:
        mla.detect_kv_tiling()
    return R
