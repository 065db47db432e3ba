"""MLA against transformers' own DeepseekV3Attention / DeepseekV2Attention, weights copied."""
import pytest
import torch

from attnlab import MultiHeadLatentAttention
from conftest import F64
from reference import rel_err

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402
from attnlab.models.adapters import cache_keyword  # noqa: E402


def _deepseek(version, q_lora_rank, interleave=True):
    if version == 3:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod
        cfg = transformers.DeepseekV3Config(rope_interleave=interleave)
        attn_cls, rot_cls = mod.DeepseekV3Attention, mod.DeepseekV3RotaryEmbedding
    else:
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as mod
        cfg = transformers.DeepseekV2Config()
        attn_cls, rot_cls = mod.DeepseekV2Attention, mod.DeepseekV2RotaryEmbedding
    for k, v in dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                     q_lora_rank=q_lora_rank, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                     head_dim=4, attention_bias=False, attention_dropout=0.0).items():
        setattr(cfg, k, v)
    cfg.qk_head_dim = 12
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = attn_cls(cfg, layer_idx=0).to(F64).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return cfg, attn, rot_cls(cfg)


def _run_hf(attn, rotary, x, positions, cache=None):
    L = x.shape[1]
    S = positions[-1].item() + 1
    allowed = torch.arange(S)[None, :] <= positions[:, None]
    mask = torch.zeros(L, S, dtype=x.dtype).masked_fill(~allowed, float("-inf"))[None, None]
    pe = rotary(x, positions[None])
    out, _ = attn(x, position_embeddings=pe, attention_mask=mask, **{cache_keyword(attn.forward): cache})
    return out


CASES = [(3, None, True), (3, 12, True), (3, 12, False), (2, 12, True)]


@pytest.mark.parametrize("version, q_lora_rank, interleave", CASES)
def test_full_forward_matches_transformers(version, q_lora_rank, interleave):
    cfg, attn, rotary = _deepseek(version, q_lora_rank, interleave)
    m = MultiHeadLatentAttention.from_transformers(attn, rotary=rotary)
    x = torch.randn(2, 7, 64, dtype=F64)
    with torch.no_grad():
        theirs = _run_hf(attn, rotary, x, torch.arange(7))
        ours = m(x, is_causal=True)
        theirs32 = _run_hf(attn.float(), rotary, x.float(), torch.arange(7))
        ours32 = m.float()(x.float(), is_causal=True)
    # transformers computes RoPE angles in float32 even for float64 inputs: agreement is float32-level
    noise = rel_err(theirs32, theirs)
    assert rel_err(ours, theirs) <= 1e-5
    assert rel_err(ours32, theirs32) <= 4 * noise + 1e-6


@pytest.mark.parametrize("version, q_lora_rank, interleave", CASES[:2] + CASES[3:])
def test_cached_decode_matches_transformers(version, q_lora_rank, interleave):
    cfg, attn, rotary = _deepseek(version, q_lora_rank, interleave)
    m = MultiHeadLatentAttention.from_transformers(attn, rotary=rotary)
    x = torch.randn(1, 9, 64, dtype=F64)
    hf_cache = DynamicCache(config=cfg)
    cache = m.init_cache(1, 9)
    theirs, ours = [], []
    with torch.no_grad():
        theirs.append(_run_hf(attn, rotary, x[:, :5], torch.arange(5), hf_cache))
        ours.append(m(x[:, :5], cache=cache, is_causal=True))
        for t in range(5, 9):
            theirs.append(_run_hf(attn, rotary, x[:, t:t + 1], torch.tensor([t]), hf_cache))
            ours.append(m(x[:, t:t + 1], cache=cache, is_causal=True, absorbed=True))
    assert rel_err(torch.cat(ours, 1), torch.cat(theirs, 1)) <= 1e-5
