"""The whole-model benchmark (`attnlab bench --suite model`): serving speed of converted models against their source.

`model_suite` measures every figure of a table in one process. Rows are variants (transformers eager and sdpa,
attnlab's GQA swap, the exact MLA, compressed MLAs, bfloat16 variants); columns are prefill, decode, peak memory,
KV bytes a token and roofline fractions. `markdown` writes the table of docs/performance.md.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from .timing import _sync, median_time

F32, BF16 = torch.float32, torch.bfloat16

# (batch, prompt, decode steps): this 2-core CPU cannot run the B in {1, 16, 64} x {2k, 8k}
# grid (SmolLM2 prefills 2k tokens in 5-8 s at B=1, 16 rows in 2-4 minutes); docs/performance.md
# says what was cut. All variants of a point are in memory at once (they take turns).
CPU_GRID = ((1, 2048, 24), (16, 2048, 8))
CPU_VARIANTS = {  # which variants run at each grid point (the others cost minutes each)
    (1, 2048): ("hf-eager", "hf-sdpa", "gqa", "mla-exact", "mla-r128-p96", "mla-r64-p48",
                "gqa-bf16", "mla-exact-bf16", "mla-r128-p96-bf16"),
    (16, 2048): ("gqa", "mla-r128-p96"),
    (1, 8192): ("gqa", "mla-exact", "mla-r128-p96"),  # not in CPU_GRID: pass grid=((1, 8192, 4),)
}
QUICK_GRID = ((2, 48, 3),)
CUDA_GRID = ((1, 8192, 32), (16, 4096, 32), (64, 8192, 16), (1, 32768, 16))
COMPRESSED = {"mla-r128-p96": (128, 96), "mla-r64-p48": (64, 48)}
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                tie_word_embeddings=True, max_position_embeddings=131072)  # meta-llama/Llama-3.2-1B config.json
LLAMA_1B_COMPRESSED = {"mla-r256-p64": (256, 64), "mla-r128-p64": (128, 64)}


def rates(device="cpu", dtypes=(F32, BF16), n: int = 1024, mbytes: int = 256, reps: int = 5) -> dict:
    """GEMM FLOP/s per dtype and copy bandwidth (bytes read + written per second), measured here."""
    if torch.device(device).type == "cuda":
        n, mbytes = 8192, 2048
    out = {}
    for dt in dtypes:
        a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
        out[f"gemm_flops_per_s_{str(dt).removeprefix('torch.')}"] = 2 * n ** 3 / median_time(lambda: a @ b, reps, device=device)
    src = torch.randn(mbytes * 2 ** 20 // 4, device=device)
    dst = torch.empty_like(src)
    out["copy_bytes_per_s"] = 2 * src.numel() * 4 / median_time(lambda: dst.copy_(src), reps, device=device)
    return out


# -- peak memory -----------------------------------------------------------------------------------
def _reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the resident high-water mark
    except OSError:
        pass


def _memory_mb(device, peak: bool) -> float | None:
    """CUDA: torch's (peak) allocation; CPU: the process's resident set (VmRSS) or its high-water mark (VmHWM)."""
    if torch.device(device).type == "cuda":
        return (torch.cuda.max_memory_allocated if peak else torch.cuda.memory_allocated)(device) / 2 ** 20
    field = "VmHWM:" if peak else "VmRSS:"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# -- models ----------------------------------------------------------------------------------------
# Rows (variants): transformers "eager" and "sdpa" (unconverted, their own DynamicCache, the loop transformers' generate
# runs); attnlab's GQA swap; the exact MLA (GQA-tiled latent, mla.py); compressed MLAs (decoupled RoPE) at two latent
# sizes; bfloat16 variants of the attnlab rows. The attnlab rows decode through attnlab.generation.Generator (static
# caches), the transformers rows through transformers' DynamicCache (the JSON says which: "loop").
def _variant(base, name: str, compressed: dict):
    """A fresh model for one row: transformers (eager/sdpa), or attnlab-swapped and maybe converted."""
    from ..models import convert_model, to_attnlab

    model = copy.deepcopy(base)
    if name.startswith("hf-"):
        model.config._attn_implementation = name[3:]
        return model
    dtype = BF16 if name.endswith("-bf16") else F32
    key = name.removesuffix("-bf16")
    to_attnlab(model)
    if key == "mla-exact":
        convert_model(model, "mla")
    elif key in compressed:
        r, p = compressed[key]
        convert_model(model, "mla", latent_dim=r, rope_dim=p)
    elif key != "gqa":
        raise ValueError(f"unknown variant {name!r}")
    return model.to(dtype)


def _weight_bytes(model) -> int:
    """Bytes of every distinct parameter, less W_UK/W_UV of MLAs that attend on GQA-tiled slices."""
    from ..modules.mla import MultiHeadLatentAttention

    seen, total = set(), 0
    skip = set()
    for m in model.modules():
        if isinstance(m, MultiHeadLatentAttention) and m.kv_tiling_holds():
            skip |= {id(m.W_UK.weight), id(m.W_UV.weight)}
    for p in model.parameters():
        if p.data_ptr() in seen or id(p) in skip:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def _prefill_flops(model, B: int, L: int) -> float:
    """2 * B * L * (weights in matrix products) + causal attention's B * H * L^2 * (qk + v) per layer."""
    from ..modules.mla import MultiHeadLatentAttention

    cfg = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attn = 0
    layers = getattr(cfg, "num_hidden_layers")
    H = cfg.num_attention_heads
    qk = v = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    for m in model.modules():
        if isinstance(m, MultiHeadLatentAttention):
            if m.kv_tiling_holds():
                linear -= m.W_UK.weight.numel() + m.W_UV.weight.numel()
            qk, v = m.head_dim + m.rope_dim, m.v_head_dim
    attn = layers * B * H * L * L * (qk + v)
    return 2.0 * B * L * linear + attn


def _kv_bytes(model, dtype) -> int:
    from ..models import attnlab_modules, kv_bytes_per_token

    try:
        attnlab_modules(model)
    except ValueError:
        cfg = model.config
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * d * torch.tensor([], dtype=dtype).element_size()
    return kv_bytes_per_token(model, dtype)


class _TransformersLoop:
    """Prefill and greedy steps through the model's forward with a DynamicCache (transformers' own loop)."""

    def __init__(self, model):
        self.model, self.cache = model, None

    def prefill(self, ids):
        from transformers import DynamicCache

        from ..models.adapters import cache_keyword

        self.cache, self.keyword = DynamicCache(), cache_keyword(self.model.forward)
        return self.model(ids, **{self.keyword: self.cache}, use_cache=True, logits_to_keep=1).logits[:, -1]

    def step(self, ids):  # ids (B,)
        return self.model(ids[:, None], **{self.keyword: self.cache}, use_cache=True).logits[:, -1]


class _GeneratorLoop:
    """attnlab.generation.Generator: static caches, one allocation for the run."""

    def __init__(self, model, B, max_len, device):
        from ..generation.generator import Generator

        self.gen = Generator(model, B, max_len, device=device)

    def prefill(self, ids):
        self.gen.reset()
        out = self.gen.prefill(ids)
        return out[:, -1] if out.dim() == 3 else out

    def step(self, ids):
        out = self.gen.step(ids)  # ids (B,)
        return out[:, -1] if out.dim() == 3 else out


def _loop(model, name, B, max_len, device):
    if not name.startswith("hf-"):
        return _GeneratorLoop(model, B, max_len, device), "generator"
    return _TransformersLoop(model), "transformers-cache"


# Columns: prefill ms (one prompt of `prompt` tokens, B rows), decode tokens/s (B / the median step), peak memory beyond
# the weights (caches + prefill activations: CPU, the process's resident high-water mark, reset through
# /proc/self/clear_refs, less the resident set before the caches were made; CUDA, torch's peak allocation less the
# allocation before), KV bytes/token, roofline fractions and ratios against the GQA swap of the same dtype, batch and
# prompt.
# Rooflines: a decode step must read every weight once (tied embedding once; a GQA-tiled MLA skips W_UK/W_UV) plus
# B * context * KV bytes/token, at the copy bandwidth measured here (bytes read + written by a large copy); prefill
# must do 2 * B * L * (weights in matrix products) plus B * H * L^2 * (qk + v head size) FLOPs (causal half) at the
# GEMM rate measured here in that dtype.
def _measure_point(models: dict, B: int, L: int, steps: int, device, rate, vocab, progress=None) -> list[dict]:
    """Rows of one (batch, prompt) point. Variants take turns, step by step, so that the load of a
    shared machine falls on all of them alike; each variant's prefill is timed once after a warm-up."""
    ids = torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(0)).to(device)
    loops, out = {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            _reset_peak(device)
            before = _memory_mb(device, peak=False)
            loop, kind = _loop(model, name, B, L + steps + 2, device)
            nxt = loop.prefill(ids[:, :16]).argmax(-1)  # warm-up of both paths, (B,)
            loop.step(nxt)
            _sync(device)
            t0 = time.perf_counter()
            logits = loop.prefill(ids)
            _sync(device)
            peak = _memory_mb(device, peak=True)
            out[name] = {"loop": kind, "prefill_s": time.perf_counter() - t0, "steps": [],
                         "next": logits.argmax(-1),  # (B,)
                         "peak_mb": None if peak is None or before is None else peak - before}
            loops[name] = loop
            if progress:
                progress(f"model {name} B={B} L={L}: prefill {out[name]['prefill_s'] * 1e3:.0f} ms")
        for _ in range(steps):
            for name, loop in loops.items():
                o = out[name]
                t0 = time.perf_counter()
                o["next"] = loop.step(o["next"]).argmax(-1)
                _sync(device)
                o["steps"].append(time.perf_counter() - t0)
    rows = []
    for name, model in models.items():
        o = out[name]
        dtype = next(model.parameters()).dtype
        step_s = statistics.median(o["steps"])
        kv = _kv_bytes(model, dtype)
        read = _weight_bytes(model) + B * (L + steps // 2) * kv
        flops = _prefill_flops(model, B, L)
        gemm = rate[f"gemm_flops_per_s_{str(dtype).removeprefix('torch.')}"]
        rows.append({"variant": name, "dtype": str(dtype).removeprefix("torch."), "batch": B, "prompt": L,
                     "loop": o["loop"], "prefill_ms": o["prefill_s"] * 1e3, "decode_ms": step_s * 1e3,
                     "decode_tok_s": B / step_s, "peak_mb": o["peak_mb"], "kv_bytes_per_token": kv,
                     "decode_read_mb": read / 1e6, "decode_roofline": read / rate["copy_bytes_per_s"] / step_s,
                     "prefill_gflop": flops / 1e9, "prefill_roofline": flops / gemm / o["prefill_s"]})
    return rows


def _ratios(rows: list[dict]) -> None:
    """prefill and decode-time ratios against the GQA swap of the same dtype, batch and prompt."""
    for r in rows:
        ref = next((g for g in rows if g["variant"] == ("gqa-bf16" if r["dtype"] == "bfloat16" else "gqa")
                    and g["batch"] == r["batch"] and g["prompt"] == r["prompt"]), None)
        r["prefill_vs_gqa"] = r["prefill_ms"] / ref["prefill_ms"] if ref else None
        r["decode_time_vs_gqa"] = r["decode_ms"] / ref["decode_ms"] if ref else None


def _llama_1b(device):
    """The Llama-3.2-1B shape with random bfloat16 weights (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA_1B)).to(device=device, dtype=BF16).eval()


def model_suite(quick: bool = False, device: str = "cpu", grid=None, variants=None, progress=None) -> list[dict]:
    """Rows of the whole-model benchmark (rows and columns: the comments above `_variant` and `_measure_point`).

    CPU: real SmolLM2-135M weights, fp32 and bf16 rows. CUDA: the Llama-3.2-1B shape, random
    bf16 weights, the issue's GPU grid. quick: a 2-layer SmolLM2-shaped model with random
    weights and a tiny grid (checks that everything runs).
    """
    cuda = torch.device(device).type == "cuda"
    if quick:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                                            num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                            vocab_size=256, tie_word_embeddings=True)).eval()
        compressed = {"mla-r24-p12": (24, 12), "mla-r12-p12": (12, 12)}
        grid = grid or QUICK_GRID
        names = ("hf-eager", "hf-sdpa", "gqa", "mla-exact", *compressed, "gqa-bf16", "mla-exact-bf16",
                 "mla-r24-p12-bf16")
        plan = {(B, L): names for B, L, _ in grid}
    elif cuda:
        base = _llama_1b(device)
        compressed = LLAMA_1B_COMPRESSED
        grid = grid or CUDA_GRID
        names = ("hf-sdpa", "gqa-bf16", "mla-exact-bf16", *(f"{k}-bf16" for k in compressed))
        plan = {(B, L): names for B, L, _ in grid}
    else:
        from ..models import load_smollm2

        base = load_smollm2()[0]
        compressed = COMPRESSED
        grid = grid or CPU_GRID
        plan = {k: CPU_VARIANTS.get(k, CPU_VARIANTS[(1, 2048)]) for k in ((B, L) for B, L, _ in grid)}
    if variants:
        plan = {k: tuple(v for v in names if v in variants) for k, names in plan.items()}
    rate = rates(device, dtypes=(BF16,) if cuda else (F32, BF16))
    vocab = base.config.vocab_size
    rows = []
    for B, L, steps in grid:
        models = {name: _variant(base, name, compressed).to(device) for name in plan[(B, L)]}
        if cuda:
            models = {k: m.to(BF16) for k, m in models.items()}
        rows += _measure_point(models, B, L, steps, device, rate, vocab, progress)
        del models
    _ratios(rows)
    for r in rows:
        r["copy_gb_s"] = rate["copy_bytes_per_s"] / 1e9
        r["gemm_gflop_s"] = rate[f"gemm_flops_per_s_{r['dtype']}"] / 1e9
    return rows


COLUMNS = (("variant", "variant", "{}"), ("batch", "B", "{}"), ("prompt", "prompt", "{}"),
           ("prefill_ms", "prefill ms", "{:.0f}"), ("prefill_vs_gqa", "prefill / GQA", "{:.2f}"),
           ("decode_tok_s", "decode tok/s", "{:.1f}"), ("decode_time_vs_gqa", "step time / GQA", "{:.2f}"),
           ("peak_mb", "peak MB over weights", "{:.0f}"), ("kv_bytes_per_token", "KV B/token", "{}"),
           ("decode_roofline", "decode roofline", "{:.0%}"), ("prefill_roofline", "prefill roofline", "{:.0%}"))


def markdown(rows: list[dict]) -> str:
    """The table of docs/performance.md."""
    out = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = ["-" if r.get(k) is None else f.format(r[k]) for k, _, f in COLUMNS]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
