"""MLA's absorbed decode in one pass over the latent cache: a Triton kernel and its PyTorch twin.

- `absorbed_decode_reference`: plain torch ops, the oracle and the fallback anywhere.
- `absorbed_decode`: the Triton kernel (mla_decode_triton.py), split along the sequence (flash-decoding).
- `try_decode`: what MultiHeadLatentAttention._absorbed calls; the kernel's output where selected and applicable.
"""
from __future__ import annotations

import importlib.util
import os

import torch

# Notation: B batch, H heads, S cache rows (the buffer may be longer than the tokens held; `lengths` says how many
# count), r = latent_dim, p = rope_dim. For each sequence b and head h, with the cache row j = [c_j, k_rope_j] (r + p)
# and the absorbed query q[b, h] = [W_UK_h^T q_nope, q_rope] (r + p):
#     s_j = (q[b, h] . kv[b, j]) * scale        for j < lengths[b] and key_padding_mask[b, j]
#     o[b, h] = sum_j softmax(s)_j c_j           (r numbers; W_UV is applied by the module)
# Softmax and accumulation run in float32 for bfloat16, float16 and float32 inputs; the output has the input dtype.
# A head with no key to attend gets zeros (as the attention core does).

# Selection by ATTNLAB_MLA_DECODE, read on every eager call (under torch.compile once, when the step is traced, where
# the kernel is the opaque operator attnlab::mla_absorbed_decode): "auto" (default) uses the kernel on CUDA when triton
# imports; "torch" never uses it; "triton" always does (CPU tensors go through triton's interpreter: slow, tests only).
ENV = "ATTNLAB_MLA_DECODE"
MODES = ("auto", "torch", "triton")


def constant_under_compile(fn):
    """torch.compiler.assume_constant_result without importing torch._dynamo at import time: the public decorator
    imports dynamo and only marks the function, so the mark is set here directly while dynamo is not loaded, and by
    the public decorator once it is (tests/test_startup.py checks that the two marks agree)."""
    import sys

    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@constant_under_compile  # traced once by torch.compile, not re-checked per step
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(tensor: torch.Tensor, *, interpret: bool = False) -> bool:
    """True where the kernel can run on `tensor`'s device: CUDA with triton importable; with
    interpret=True also the CPU when TRITON_INTERPRET=1 (which triton reads once, when imported)."""
    if not _triton_importable():
        return False
    return tensor.is_cuda or (interpret and os.environ.get("TRITON_INTERPRET") == "1")


@constant_under_compile
def mode() -> str:
    """The selection policy from ATTNLAB_MLA_DECODE: "auto", "torch" or "triton"."""
    m = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, got {m!r}")
    return m


# -- inputs --------------------------------------------------------------------------------------
# A quantised cache (modules/cache.py) comes as its codes, kv (B, S, r+p) int8 or float8_e4m3fn, and float32 kv_scales
# (B, S, n): one scale for the latent part and one for the rope part of each row, or with scale_group = g one per g
# channels of each part (n = ceil(r/g) + ceil(p/g)). Both readers dequantise a row as the cache does, (code * scale) in
# float32 (float64 for float64 q) rounded to q's dtype, and go on as with a plain cache of those values: the twin up
# front, the kernel in its tile load.
CODES = (torch.int8, getattr(torch, "float8_e4m3fn", torch.int8))  # the storage dtypes of a quantised cache


def _scale_columns(latent_dim: int, rope_dim: int, scale_group: int | None) -> tuple[int, int, int]:
    """(channels per latent scale, channels per rope scale, number of latent scales)."""
    gr = latent_dim if scale_group is None else min(scale_group, latent_dim)
    gp = max(rope_dim, 1) if scale_group is None else min(scale_group, max(rope_dim, 1))
    return gr, gp, -(-latent_dim // gr)


def _check_scales(kv, kv_scales, scale_group, latent_dim: int) -> None:
    """A quantised kv comes with its scales (see the comment above CODES); a floating one without."""
    quantised = kv.dtype in CODES
    if kv_scales is None:
        if quantised:
            raise ValueError(f"kv holds {kv.dtype} codes but no kv_scales were given: a quantised cache is read "
                             "with its scales (B, S, n)")
        if scale_group is not None:
            raise ValueError(f"scale_group {scale_group!r} given without kv_scales")
        return
    if not quantised:
        raise ValueError(f"kv_scales given but kv is {kv.dtype}: scales belong to an int8 or float8_e4m3fn cache")
    if scale_group is not None and (isinstance(scale_group, bool) or not isinstance(scale_group, int)
                                    or scale_group < 1):
        raise ValueError(f"scale_group must be a positive int or None, got {scale_group!r}")
    B, S, width = kv.shape
    p = width - latent_dim
    gr, gp, n_lat = _scale_columns(latent_dim, p, scale_group)
    n = n_lat + (-(-p // gp) if p else 0)
    if not isinstance(kv_scales, torch.Tensor) or kv_scales.dtype != torch.float32:
        raise TypeError(f"kv_scales must be a float32 tensor (B, S, n), got "
                        f"{kv_scales.dtype if isinstance(kv_scales, torch.Tensor) else type(kv_scales).__name__}")
    if tuple(kv_scales.shape) != (B, S, n) or kv_scales.device != kv.device:
        raise ValueError(f"kv_scales must have shape (B, S, n) = {(B, S, n)} (scale_group {scale_group}) on "
                         f"{kv.device}, got {tuple(kv_scales.shape)} on {kv_scales.device}")


def _check(q, kv, lengths, latent_dim, key_padding_mask, kv_scales=None, scale_group=None) -> torch.Tensor:
    """Validate; return lengths as a (B,) int32 tensor on kv's device."""
    for name, t, dims in (("q", q, "(B, H, r+p)"), ("kv", kv, "(B, S, r+p)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {dims}, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape {dims}, got {tuple(t.shape)}")
    if not q.is_floating_point() or q.device != kv.device or (q.dtype != kv.dtype and kv.dtype not in CODES):
        raise TypeError(f"q and kv must share a floating dtype (or kv hold int8 or float8_e4m3fn codes) and a "
                        f"device, got q {q.dtype} on {q.device}, kv {kv.dtype} on {kv.device}")
    B, S, width = kv.shape
    if q.shape[0] != B or q.shape[2] != width:
        raise ValueError(f"q {tuple(q.shape)} must be (B, H, r+p) = ({B}, H, {width}) to match kv {tuple(kv.shape)}")
    if isinstance(latent_dim, bool) or not isinstance(latent_dim, int) or not 0 < latent_dim <= width:
        raise ValueError(f"latent_dim must be an int in 1..{width} (the cache row width), got {latent_dim!r}")
    _check_scales(kv, kv_scales, scale_group, latent_dim)
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        if not 0 <= lengths <= S:
            raise ValueError(f"lengths must lie in 0..{S} (the cache rows), got {lengths}")
        lengths = torch.full((B,), lengths, dtype=torch.int32, device=kv.device)
    elif isinstance(lengths, torch.Tensor) and not lengths.is_floating_point() and lengths.dtype != torch.bool:
        if tuple(lengths.shape) != (B,):
            raise ValueError(f"lengths must be an int or a (B,) = ({B},) tensor, got shape {tuple(lengths.shape)}")
        lengths = lengths.to(device=kv.device, dtype=torch.int32)
    else:
        raise TypeError(f"lengths must be an int or an integer tensor of shape (B,), got {type(lengths).__name__}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor (True = may attend)")
        if tuple(key_padding_mask.shape) != (B, S):
            raise ValueError(f"key_padding_mask must have shape (B, S) = {(B, S)}, "
                             f"got {tuple(key_padding_mask.shape)}")
    return lengths


# -- the PyTorch twin ----------------------------------------------------------------------------
def dequantised(kv: torch.Tensor, kv_scales: torch.Tensor, latent_dim: int, scale_group: int | None,
                dtype: torch.dtype) -> torch.Tensor:
    """Codes kv (B, S, r+p) with scales (B, S, n) -> (code * scale) (B, S, r+p) in `dtype`, as the cache reads them."""
    r, p = latent_dim, kv.shape[-1] - latent_dim
    gr, gp, n_lat = _scale_columns(r, p, scale_group)
    col = torch.arange(r + p, device=kv.device)  # (r+p,)
    col = torch.where(col < r, col // gr, n_lat + (col - r) // gp)  # (r+p,): the scale of each channel
    work = torch.promote_types(dtype, torch.float32)
    return (kv.to(work) * kv_scales.index_select(-1, col).to(work)).to(dtype)  # (B, S, r+p)


def absorbed_decode_reference(q: torch.Tensor, kv: torch.Tensor, lengths, scale: float, latent_dim: int,
                         key_padding_mask: torch.Tensor | None = None, *, kv_scales: torch.Tensor | None = None,
                         scale_group: int | None = None) -> torch.Tensor:
    """q (B, H, r+p), kv (B, S, r+p) -> (B, H, r), with the kernel's arithmetic in plain torch ops.

    Scores and softmax in at least float32 (float64 stays float64); the softmax
    weights are rounded to the input dtype before the weighted sum, as the kernel does.
    kv_scales, scale_group: for a quantised kv (int8 or float8_e4m3fn codes), see the comment above CODES.
    """
    lengths = _check(q, kv, lengths, latent_dim, key_padding_mask, kv_scales, scale_group)
    if kv_scales is not None:
        kv = dequantised(kv, kv_scales, latent_dim, scale_group, q.dtype)  # (B, S, r+p)
    B, S, _ = kv.shape
    work = torch.promote_types(q.dtype, torch.float32)
    keep = torch.arange(S, device=kv.device)[None, :] < lengths[:, None]  # (B, S)
    if key_padding_mask is not None:
        keep = keep & key_padding_mask.to(kv.device)
    s = (q.to(work) @ kv.to(work).transpose(1, 2)) * scale  # (B, H, S)
    s = s.masked_fill(~keep[:, None, :], float("-inf"))  # (B, H, S)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # (B, H, S), zeros for a head with nothing to attend
    return (p.to(kv.dtype) @ kv[..., :latent_dim]).to(q.dtype)  # (B, H, r)


# -- the Triton kernel ---------------------------------------------------------------------------
def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so tests exercise the combine step


PARTIAL_SHARE = 4  # a split reads at least this many times the bytes its partial result writes and rereads


def plan(batch: int, num_heads: int, rows: int, latent_dim: int, device: torch.device,
         num_splits: int | None = None, block_n: int | None = None,
         row_bytes: int | None = None,  # bytes of one cache row; default 2 * latent_dim (16-bit, no rope)
         element_size: int = 2,  # bytes of an activation (q)
         quantised: bool = False) -> dict:  # the cache holds codes and scales
    """Launch geometry: heads per program (BH), rows per tile (BN), splits of the sequence (num_splits, chunk).

    Without num_splits the sequence is split until there is about one program per SM, each split keeping at least
    4 tiles and reading at least PARTIAL_SHARE times the bytes of its float32 partial accumulator.
    Raises ValueError for a block_n that is not a power of two >= 16 or a num_splits that is not a positive int.
    """
    BR = _pow2(latent_dim)
    wide = element_size >= 4
    # Heads per program: a power of two, >= 16 for tl.dot, capped so that the float32 accumulator stays at 16 x 512
    # values. float32 inputs (element_size 4, whose tl.dot runs on CUDA cores in full precision) take 16 heads and
    # 2 pipeline stages, which compile for sm_90 without register spills (1 stage when float32 activations read a
    # quantised cache: 2 stages spill).
    BH = 16 if wide else max(16, min(64, _pow2(num_heads), (16 * 512) // BR))
    BN = block_n if block_n is not None else (32 if BR >= 256 or wide else 64)
    if isinstance(BN, bool) or not isinstance(BN, int) or BN < 16 or BN & (BN - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {BN!r}")
    head_blocks = -(-num_heads // BH)
    tiles = max(1, -(-rows // BN))
    if num_splits is None:
        # a split reads >= PARTIAL_SHARE times its partial's bytes: partials cost <= ~1/PARTIAL_SHARE of the traffic
        partial = 2 * num_heads * BR * 4  # bytes per split: float32 accumulators, written and read back
        min_rows = max(4 * BN, PARTIAL_SHARE * partial // (row_bytes or 2 * latent_dim))
        wanted = -(-_sm_count(device) // (batch * head_blocks))
        num_splits = max(1, min(wanted, rows // min_rows))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    num_splits = min(num_splits, tiles)
    chunk = -(-tiles // num_splits) * BN  # rows per split, a whole number of tiles
    num_splits = -(-max(rows, 1) // chunk)
    return dict(BH=BH, BN=BN, BR=BR, head_blocks=head_blocks, num_splits=num_splits, chunk=chunk,
                num_warps=8 if BR >= 256 or wide else 4, num_stages=(1 if quantised else 2) if wide else 3)


def absorbed_decode(q: torch.Tensor, kv: torch.Tensor, lengths, scale: float, latent_dim: int,
               key_padding_mask: torch.Tensor | None = None, *, kv_scales: torch.Tensor | None = None,
               scale_group: int | None = None, num_splits: int | None = None,
               block_n: int | None = None) -> torch.Tensor:
    """The Triton kernel: q (B, H, r+p), kv (B, S, r+p) -> (B, H, r); same contract as the twin.

    kv_scales, scale_group: a quantised kv, dequantised in the tile load; num_splits and block_n override `plan`.
    CUDA tensors run compiled, CPU tensors in triton's interpreter. The grid depends only on the shapes, not on
    `lengths`, so a static cache buffer with a lengths tensor can be captured in a CUDA graph.
    """
    lengths = _check(q, kv, lengths, latent_dim, key_padding_mask, kv_scales, scale_group)
    B, S, width = kv.shape
    H, r, p = q.shape[1], latent_dim, width - latent_dim
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    quant = 0 if kv_scales is None else 1 if kv.dtype == torch.int8 else 2  # 2: float8_e4m3fn, decoded from its bits
    if quant == 2:
        kv = kv.view(torch.uint8)
    if kv_scales is not None and kv_scales.stride(-1) != 1:
        kv_scales = kv_scales.contiguous()
    if scale_group is not None and scale_group & (scale_group - 1):
        raise ValueError(f"the kernel reads scale groups of a power of two channels, got scale_group {scale_group}; "
                         "use absorbed_decode_reference")
    n_lat = _scale_columns(r, p, scale_group)[2]
    n_rope = 0 if kv_scales is None else kv_scales.shape[-1] - n_lat
    scales = kv_scales if kv_scales is not None else lengths  # a placeholder pointer when not quantised, never read
    from . import mla_decode_triton as kernels
    interpreted = kernels.interpreted()
    if not kv.is_cuda and not interpreted:
        raise ValueError(f"the Triton kernel needs CUDA tensors, got {kv.device}; on the CPU it runs only when "
                         "triton was imported with TRITON_INTERPRET=1 (tests); use absorbed_decode_reference")
    row_bytes = width * kv.element_size() + (0 if kv_scales is None else kv_scales.shape[-1] * 4)
    g = plan(B, H, S, r, kv.device, num_splits, block_n, row_bytes=row_bytes, element_size=q.element_size(),
             quantised=kv_scales is not None)
    T, BR, BP = g["num_splits"], g["BR"], _pow2(p)
    GR, GP = (BR, BP) if scale_group is None else (min(scale_group, BR), min(scale_group, BP))  # see the kernel
    out = torch.empty(B, H, r, dtype=q.dtype, device=q.device)  # (B, H, r)
    if T > 1:
        m_part = torch.empty(B, H, T, dtype=torch.float32, device=q.device)  # (B, H, T)
        l_part = torch.empty_like(m_part)  # (B, H, T)
        acc_part = torch.empty(B, H, T, BR, dtype=torch.float32, device=q.device)  # (B, H, T, BR)
    else:
        m_part = l_part = acc_part = out  # unused by the kernel when it writes the output itself
    if key_padding_mask is not None:
        keep = key_padding_mask.to(kv.device).view(torch.uint8)  # (B, S), 1 = may attend
        keep = keep if keep.stride(-1) == 1 else keep.contiguous()
    else:
        keep = lengths  # a placeholder pointer, never read
    dot_f32 = interpreted and q.dtype == torch.bfloat16  # see DOT_F32 in mla_decode_triton.py
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding; 16-bit: ignored
    kernels.split_kernel[(B, g["head_blocks"], T)](
        q, kv, scales, lengths, keep, out, m_part, l_part, acc_part,
        H, r, p, g["chunk"], float(scale) * kernels.LOG2E, n_lat, n_rope,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), scales.stride(0),
        scales.stride(1) if kv_scales is not None else 0, keep.stride(0),
        out.stride(0), out.stride(1), H * T, T, 1,
        BH=g["BH"], BN=g["BN"], BR=BR, BP=BP, HAS_ROPE=p > 0, HAS_KEEP=key_padding_mask is not None,
        SPLIT=T > 1, QUANT=quant, GR=GR, GP=GP, PRECISION=precision,
        DOT_F32=dot_f32, num_warps=g["num_warps"], num_stages=g["num_stages"])
    if T > 1:
        kernels.combine_kernel[(B, H)](out, m_part, l_part, acc_part, r, T, out.stride(0), out.stride(1), H * T, T, 1,
                                       BT=_pow2(T, least=2), BR=BR, DOT_F32=dot_f32, num_warps=4)
    return out


# The kernel as an opaque torch operator, for torch.compile: dynamo does not trace the launch
# (no graph break), and a CUDA graph captures its two kernels like any other op.
@torch.library.custom_op("attnlab::mla_absorbed_decode", mutates_args=())
def _absorbed_decode_op(q: torch.Tensor, kv: torch.Tensor, length: int, scale: float, latent_dim: int,
                        key_padding_mask: torch.Tensor | None, kv_scales: torch.Tensor | None,
                        scale_group: int | None) -> torch.Tensor:
    return absorbed_decode(q, kv, length, scale, latent_dim, key_padding_mask, kv_scales=kv_scales,
                           scale_group=scale_group)


@_absorbed_decode_op.register_fake
def _(q, kv, length, scale, latent_dim, key_padding_mask, kv_scales, scale_group):
    return q.new_empty(q.shape[0], q.shape[1], latent_dim)  # (B, H, r)


# -- dispatch from the module --------------------------------------------------------------------
def _key_mask(mask, B: int, S: int):
    """A mask that only hides keys, same for every head: (B, S) bool, None for no mask, False if it is more."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() not in (2, 3, 4):
        return False
    # read as the attention core does: (L, S), (B, L, S) or (B|1, H|1, L|1, S), here with L == 1
    m = mask[None, None] if mask.dim() == 2 else mask[:, None] if mask.dim() == 3 else mask  # (B|1, H|1, 1, S)
    if m.shape[1] != 1 or m.shape[2] != 1 or m.shape[0] not in (1, B) or m.shape[3] != S:
        return False
    return m[:, 0, 0, :].expand(B, S)  # (B, S)


def try_decode(q: torch.Tensor, kv: torch.Tensor, mask, scale: float, latent_dim: int, *,
               kv_scales: torch.Tensor | None = None, scale_group: int | None = None) -> torch.Tensor | None:
    """The kernel's (B, H, 1, r) for an absorbed decode step q (B, H, 1, r+p) against kv (B, S, r+p)
    (a quantised cache's codes with kv_scales and scale_group), or None where it does not apply
    (several query rows, a float or per-head mask, autograd) or is not selected (ATTNLAB_MLA_DECODE, device)."""
    m = mode()
    if m == "torch" or q.shape[2] != 1:
        return None
    if m == "auto" and not available(q):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad):
        return None
    B, S = kv.shape[0], kv.shape[1]
    keys = _key_mask(mask, B, S)
    if keys is False:
        return None
    if scale_group is not None and (scale_group & (scale_group - 1) or q.dtype == torch.float32):
        return None  # groups the kernel does not read (or, with float32 activations, spills on): the PyTorch path
    if m == "triton" and not _triton_importable():
        raise ValueError(f"{ENV}=triton but triton is not installed (pip install 'attnlab[kernels]')")
    if torch.compiler.is_compiling():
        out = _absorbed_decode_op(q[:, :, 0], kv, S, scale, latent_dim, keys, kv_scales, scale_group)
    else:
        out = absorbed_decode(q[:, :, 0], kv, S, scale, latent_dim, keys, kv_scales=kv_scales,
                              scale_group=scale_group)
    return out[:, :, None]  # (B, H, 1, r)
