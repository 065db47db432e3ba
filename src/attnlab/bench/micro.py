"""Micro benchmarks of attnlab against torch and transformers, every comparison measured in one process.

Each figure is the median of repeated runs after a warm-up (timing.py); ratios compare numbers of the same run.
Suites: `decode_suite`, `deepseek_suite`, `prefill_suite`, `memory_suite`, `convert_suite` (and model.py's
`--suite model`: whole models), run by name by suites.run_benchmarks.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from ..modules.gqa import GroupedQueryAttention, MultiHeadAttention
from ..modules.mla import MultiHeadLatentAttention
from .timing import measure_rates, median_time

F32 = torch.float32


# -- decode ----------------------------------------------------------------------------------------
# One decode step, B=1, float32, MHA / GQA / MLA expanded / MLA absorbed, at several context lengths, with each
# variant's roofline fraction from the matrix-multiply rate and memory bandwidth measured in the same run.
def _decode_cost(kind: str, dim: int, H: int, d: int, G: int, r: int, S: int, elt: int = 4) -> tuple[float, float]:
    """(FLOPs, bytes read) of one decode step over S cached tokens: weights, cache, up-projections."""
    if kind in ("mha", "gqa"):
        weights = dim * H * d * 2 + dim * G * d * 2
        flops = 2 * weights + 2 * H * S * d * 2
        return flops, (weights + 2 * G * d * S) * elt
    weights = dim * H * d + dim * r + r * H * d * 2 + H * d * dim
    if kind == "mla-expanded":
        flops = 2 * weights + 2 * S * r * H * d * 2 + 2 * H * S * d * 2
        return flops, (weights + S * r) * elt
    flops = 2 * weights + 2 * H * S * r * 2  # absorbed: scores and values inside the latent
    return flops, (weights + S * r) * elt


def _decode_step_fn(module, cache, S: int, x: torch.Tensor | None = None, **kw):
    """One decode step from S - 1 cached tokens to S (the cache is truncated back before each call)."""
    x = torch.randn(1, 1, module.dim, device=cache.device) if x is None else x

    def step():
        cache.truncate(S - 1)
        with torch.no_grad():
            return module(x, cache=cache, **kw)
    return step


def decode_suite(contexts=(1024, 4096, 16384), dim=4096, H=32, d=128, G=8, r=512, reps=5,
                 rates: dict | None = None, progress=None, device="cpu") -> list[dict]:
    torch.manual_seed(0)
    rates = rates or measure_rates(device=device)
    where = dict(device=device)
    variants = {
        "mha": (MultiHeadAttention(dim, H, head_dim=d, **where), {}),
        "gqa": (GroupedQueryAttention(dim, H, G, head_dim=d, grouping="blocked", **where), {}),
        "mla-expanded": (MultiHeadLatentAttention(dim, H, r, head_dim=d, **where), {"absorbed": False}),
        "mla-absorbed": (MultiHeadLatentAttention(dim, H, r, head_dim=d, **where), {"absorbed": True}),
    }
    rows = []
    for S in contexts:
        times = {}
        for name, (module, kw) in variants.items():
            module.eval()
            cache = module.init_cache(1, S)
            for t in cache.tensors():
                t.normal_()
            cache._length = S  # the cache content is random; only its size matters for time
            times[name] = median_time(_decode_step_fn(module, cache, S, **kw), reps, device=device)
            flops, nbytes = _decode_cost(name, dim, H, d, G if name == "gqa" else H, r, S)
            roof = max(flops / rates["flops_per_s"], nbytes / rates["bytes_per_s"])
            rows.append({"context": S, "variant": name, "ms": times[name] * 1e3, "gflop": flops / 1e9,
                         "mbytes": nbytes / 1e6, "roofline_ms": roof * 1e3, "roofline_fraction": roof / times[name]})
            del cache
            if progress:
                progress(f"decode {name} @ {S}")
        for row in rows[-len(variants):]:
            row["speedup_of_absorbed"] = times[row["variant"]] / times["mla-absorbed"]
    return rows


# -- deepseek --------------------------------------------------------------------------------------
# MLA decode against transformers' DeepseekV3Attention with the same weights and its own DynamicCache (needs
# transformers).
def deepseek_suite(context=4096, reps=5, hidden=2048, heads=16, kv_lora_rank=512, qk_nope=128, qk_rope=64,
                   v_head=128, progress=None, device="cpu") -> list[dict]:
    """attnlab absorbed decode vs transformers' DeepseekV3Attention (re-expands the cache each step)."""
    from transformers import DeepseekV3Config
    from transformers.cache_utils import DynamicCache
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    from ..models.adapters import cache_keyword

    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                           kv_lora_rank=kv_lora_rank, q_lora_rank=None, qk_nope_head_dim=qk_nope,
                           qk_rope_head_dim=qk_rope, v_head_dim=v_head, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    theirs = DeepseekV3Attention(cfg, layer_idx=0).eval().to(device)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.02)
    rotary = DeepseekV3RotaryEmbedding(cfg).to(device)
    ours = MultiHeadLatentAttention.from_transformers(theirs, rotary=rotary).eval()
    x = torch.randn(1, 1, hidden, device=device)
    latent = torch.randn(1, 1, context - 1, kv_lora_rank, device=device)
    k_rot = torch.randn(1, 1, context - 1, qk_rope, device=device)
    hf_cache = DynamicCache(config=cfg)
    hf_cache.update(latent, k_rot, 0)
    pos = torch.tensor([[context - 1]], device=device)
    pe = rotary(x, pos)

    keyword = cache_keyword(theirs.forward)

    def theirs_step():
        extra = hf_cache.get_seq_length() - (context - 1)
        if extra > 0:
            hf_cache.crop(-extra)  # this transformers' crop takes a negative count of tokens to drop
        with torch.no_grad():
            return theirs(x, position_embeddings=pe, attention_mask=None, **{keyword: hf_cache})[0]

    cache = ours.init_cache(1, context)
    cache.kv[0, :context - 1, :kv_lora_rank] = latent[0, 0]
    # transformers caches the interleaved rotary key de-interleaved ([even dims, odd dims]); attnlab keeps pairs
    cache.kv[0, :context - 1, kv_lora_rank:] = k_rot[0, 0].unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
    cache._length = context - 1
    ours_step = _decode_step_fn(ours, cache, context, x, absorbed=True, positions=pos[0])
    with torch.no_grad():
        a, b = theirs_step(), ours_step()
    agree = float((a - b).norm() / a.norm())
    t_theirs = median_time(theirs_step, reps, device=device)
    t_ours = median_time(ours_step, reps, device=device)
    if progress:
        progress("deepseek")
    return [{"context": context, "transformers_ms": t_theirs * 1e3, "attnlab_ms": t_ours * 1e3,
             "speedup": t_theirs / t_ours, "relative_difference": agree}]


# -- prefill ---------------------------------------------------------------------------------------
# MultiHeadAttention against torch.nn.MultiheadAttention (copied weights); GQA against the same computation with K/V
# repeated.
def prefill_suite(B=4, L=1024, dim=1024, H=16, G=4, reps=5, progress=None) -> list[dict]:
    torch.manual_seed(0)
    ours = MultiHeadAttention(dim, H, bias=True).eval()
    ref = torch.nn.MultiheadAttention(dim, H, bias=True, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.W_Q.weight, ours.W_K.weight, ours.W_V.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.W_Q.bias, ours.W_K.bias, ours.W_V.bias]))
        ref.out_proj.weight.copy_(ours.W_O.weight)
        ref.out_proj.bias.copy_(ours.W_O.bias)
    x = torch.randn(B, L, dim)
    with torch.no_grad():
        t_ref = median_time(lambda: ref(x, x, x, need_weights=False), reps)
        t_ours = median_time(lambda: ours(x), reps)
        agree = float((ours(x) - ref(x, x, x, need_weights=False)[0]).norm() / ours(x).norm())
    if progress:
        progress("prefill mha")
    gqa = GroupedQueryAttention(dim, H, G, grouping="blocked").eval()

    def repeated():  # the same GQA with K/V copied to H heads, as transformers' repeat_kv does
        d = dim // H
        q = gqa.W_Q(x).view(B, L, H, d).transpose(1, 2)
        k = gqa.W_K(x).view(B, L, G, d).transpose(1, 2).repeat_interleave(H // G, dim=1)
        v = gqa.W_V(x).view(B, L, G, d).transpose(1, 2).repeat_interleave(H // G, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return gqa.W_O(o.transpose(1, 2).reshape(B, L, dim))

    with torch.no_grad():
        t_rep = median_time(repeated, reps)
        t_gqa = median_time(lambda: gqa(x, is_causal=True), reps)
    if progress:
        progress("prefill gqa")
    return [{"case": f"MHA vs nn.MultiheadAttention (B={B}, L={L}, dim={dim}, H={H})", "attnlab_ms": t_ours * 1e3,
             "peer_ms": t_ref * 1e3, "ratio": t_ours / t_ref, "relative_difference": agree},
            {"case": f"GQA G={G} causal vs K/V repeated", "attnlab_ms": t_gqa * 1e3, "peer_ms": t_rep * 1e3,
             "ratio": t_gqa / t_rep}]


# -- memory ----------------------------------------------------------------------------------------
# Peak resident memory of a GQA forward against MHA with the same H, each measured in a fresh subprocess.
_PEAK_SCRIPT = r"""
import sys, torch
from attnlab import GroupedQueryAttention

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

dim, H, G, B, L = map(int, sys.argv[1:6])
m = GroupedQueryAttention(dim, H, G, grouping="blocked").eval()
x = torch.randn(B, L, dim)
with torch.no_grad():
    m(x[:, :8], is_causal=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current one
    before = status("VmRSS")
    m(x, is_causal=True)
    print(status("VmHWM") - before)
"""


def peak_forward_bytes(dim: int, H: int, G: int, B: int, L: int) -> int:
    """Growth of peak resident memory during one forward, in a fresh process (Linux /proc)."""
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, *map(str, (dim, H, G, B, L))],
                         capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return int(out.stdout.strip().splitlines()[-1])


def memory_suite(dim=4096, H=32, G=8, B=1, L=8192, progress=None) -> list[dict]:
    mha = peak_forward_bytes(dim, H, H, B, L)
    gqa = peak_forward_bytes(dim, H, G, B, L)
    if progress:
        progress("memory")
    return [{"case": f"forward dim={dim} H={H} B={B} L={L}", "mha_peak_mb": mha / 2 ** 20,
             "gqa_peak_mb": gqa / 2 ** 20, "gqa_over_mha": gqa / max(mha, 1)}]


# -- convert ---------------------------------------------------------------------------------------
# Factoring a tiled GQA projection through its rank (Part 9) from the tiling's structure against an SVD of the tiled
# matrix.
def convert_suite(D=4096, H=32, G=8, d=128, reps=3, progress=None) -> list[dict]:
    """Part 9's factorisation of a tiled GQA projection: the tiling's structure vs an SVD of the tiled matrix."""
    from ..convert.linalg import factor_tiled
    from ..modules.heads import tile_heads

    torch.manual_seed(0)
    block = torch.randn(G * d, D)
    tiled = tile_heads(block, H, G, "strided")
    rows, times = [], {}
    for method in ("select", "block-svd", "tiled-svd"):
        up, down = factor_tiled(block, H, G, "strided", method)
        err = float((up @ down - tiled).norm() / tiled.norm())
        times[method] = median_time(lambda: factor_tiled(block, H, G, "strided", method), reps, warmup=0)
        rows.append({"method": method, "ms": times[method] * 1e3, "rank": down.shape[0], "relative_error": err})
        if progress:
            progress(f"convert {method}")
    for row in rows:
        row["speedup_vs_tiled_svd"] = times["tiled-svd"] / times[row["method"]]
    return rows


