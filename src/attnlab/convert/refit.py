"""Closed-form refits of an MLA's up-projections against its quantised latent (issue `eighth`, part 4).

A cached latent c is read back as c^ = Q(c), the storage's codes (modules/storage.py round_trip). The keys and values
the module reads are W_UK c^ and W_UV c^; what they were meant to be is W_UK c and W_UV c. Over the calibration
tokens (C, C^: N x r, the latent and its read-back, float64), the up-projection that makes the read-back's keys and
values closest to the intended ones in least squares is

    W_U' = argmin_W |C^ W^T - C W_U^T|^2 = (C W_U^T)^T C^ (C^T^ C^ + eps I)^-1,

one solve per module for W_UK and W_UV together (eps = 1e-9 of the mean diagonal keeps a component the codes never
moved well posed). Where the storage is plain (C^ = C) it returns W_U itself. The rows are the module's own cached
rows, [c, k_R] with the rope key turned at the calibration positions, so that a storage whose rope key is coded
per channel over groups of tokens (+c4) is applied as the cache applies it.

`refit_out` refits any attnlab attention module's output projection W_O (and its bias) in least squares so that the
module's output from given inputs is closest to given targets (a heal's layer-wise phase: the teacher's attention
output), with the heads' outputs o (N x h d_v, what W_O reads) held as they are:

    W_O' = argmin_W |O W^T - Y|^2 + lam |W - W_O|^2 = (Y^T O + lam W_O)(O^T O + lam I)^-1,

lam = OUT_RIDGE of the mean diagonal of O^T O: a direction the inputs never excite keeps its old weights. The
normal equations are summed over chunks of windows in float64. Core: torch only.
"""
from __future__ import annotations

import torch

from ..modules.storage import round_trip

F64 = torch.float64
RIDGE = 1e-9


def latent_pairs(mla, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, C^) (N, r) float64: the latent of the calibration rows `inputs` (N, context_dim, one sequence in order) and
    what the module's storage reads back for it (C itself for a plain storage)."""
    with torch.no_grad():
        x = inputs.to(mla.W_DKV.weight.dtype)[None]  # (1, N, dim)
        rows = mla.compress(x, torch.arange(x.shape[1], device=x.device))  # (1, N, r + p)
        stored = rows if mla.kv_dtype is None else round_trip(rows, mla.kv_dtype, mla._kv_parts())
    r = mla.latent_dim
    return rows[0, :, :r].to(F64), stored[0, :, :r].to(F64)


def refit_up(mla, inputs: torch.Tensor, which: str = "kv") -> dict:
    """Refit W_UK and W_UV ("kv"), or W_UV alone ("v"), in place (module docstring); returns the keys' and values' mean squared error per token on
    the calibration rows before and after. ValueError for a latent norm (the read-back then passes through it) or a
    GQA tiling (the fit would break the tiling)."""
    if mla.kv_norm is not None or mla.kv_tiling is not None:
        raise ValueError("refit_up fits the up-projections to the raw latent; a latent norm (a GGUF's) or a GQA "
                         "tiling is not refitted")
    if which not in ("kv", "v"):
        raise ValueError(f"which must be 'kv' (keys and values) or 'v' (values alone), got {which!r}")
    C, Ch = latent_pairs(mla, inputs)
    ups = [mla.W_UK, mla.W_UV] if which == "kv" else [mla.W_UV]
    W = torch.cat([up.weight.detach() for up in ups]).to(F64)  # (out, r)
    target = C @ W.T  # (N, out): the keys and values the latent is meant to give
    gram = Ch.T @ Ch
    ridge = RIDGE * float(gram.diagonal().mean()) * torch.eye(gram.shape[0], dtype=F64)
    new = torch.linalg.solve(gram + ridge, Ch.T @ target).T  # (out, r)
    before = float(((Ch @ W.T - target) ** 2).sum(1).mean())
    after = float(((Ch @ new.T - target) ** 2).sum(1).mean())
    if after > before:  # the ridge can only cost where nothing was wrong: keep the original then
        return {"before": before, "after": before, "refitted": False}
    with torch.no_grad():
        start = 0
        for up in ups:
            up.weight.copy_(new[start:start + up.weight.shape[0]].to(up.weight.dtype))
            start += up.weight.shape[0]
    return {"before": before, "after": after, "refitted": True}


OUT_RIDGE = 1e-4  # refit_out's lam, a share of mean diag(O^T O)


def _gram(module, inputs: torch.Tensor, targets: torch.Tensor, chunk: int):
    """(G, B, yy, n): sum of [o, 1]^T [o, 1], of [o, 1]^T y and of |y|^2 over every position (float64), and the
    positions' count, where o is what the module's W_O reads from `inputs` (the last column 1 only with a bias)."""
    seen = []

    def read(_mod, args):
        seen.append(args[0].detach())

    bias = module.W_O.bias is not None
    G = B = None
    yy, n = 0.0, 0
    hook = module.W_O.register_forward_pre_hook(read)
    try:
        with torch.no_grad():
            for c in range(0, inputs.shape[0], chunk):
                seen.clear()
                module(inputs[c:c + chunk].to(module.W_O.weight.dtype), is_causal=True)
                o = seen[0].reshape(-1, seen[0].shape[-1]).to(F64)  # (n, h d_v)
                if bias:
                    o = torch.cat([o, o.new_ones(o.shape[0], 1)], 1)
                y = targets[c:c + chunk].reshape(o.shape[0], -1).to(device=o.device, dtype=F64)  # (n, dim)
                G = o.T @ o if G is None else G + o.T @ o
                B = o.T @ y if B is None else B + o.T @ y
                yy, n = yy + float((y * y).sum()), n + o.shape[0]
    finally:
        hook.remove()
    return G, B, yy, n


def refit_out(module, inputs: torch.Tensor, targets: torch.Tensor, *, chunk: int = 8,
              ridge: float = OUT_RIDGE) -> dict:
    """Refit `module`'s W_O (and bias) in place (module docstring) so that module(inputs) is closest to `targets`.

    inputs, targets: (n, T, dim) windows (causal attention over each). Returns the normalised squared error
    |out - targets|^2 / |targets|^2 before and after, on these windows. ValueError for inputs and targets of
    different shapes or a module without a W_O.
    """
    if not isinstance(getattr(module, "W_O", None), torch.nn.Linear):
        raise ValueError(f"refit_out refits an attention module's W_O (nn.Linear); {type(module).__name__} has none")
    if inputs.shape[:2] != targets.shape[:2] or inputs.dim() != 3 or targets.shape[-1] != module.W_O.out_features:
        raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must be (n, T, dim) "
                         f"windows alike, targets of the module's output size {module.W_O.out_features}")
    G, B, yy, _ = _gram(module, inputs, targets, chunk)
    lin = module.W_O
    old = lin.weight.detach().to(F64)
    if lin.bias is not None:
        old = torch.cat([old, lin.bias.detach().to(F64)[:, None]], 1)  # (dim, h d_v + 1)
    lam = ridge * float(G.diagonal().mean())
    new = torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=F64, device=G.device),
                             B + lam * old.T.to(G.device)).T  # (dim, h d_v [+ 1])

    def error(W):  # |O W^T - Y|^2 / |Y|^2 from the sums
        W = W.to(G.device)
        return float((yy - 2 * (W * B.T).sum() + (W @ G * W).sum()) / max(yy, 1e-300))

    before, after = error(old), error(new)
    with torch.no_grad():
        k = lin.in_features
        lin.weight.copy_(new[:, :k].to(lin.weight.device, lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_(new[:, k].to(lin.bias.device, lin.bias.dtype))
    return {"before": before, "after": after}
