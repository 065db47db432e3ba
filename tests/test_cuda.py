"""CUDA paths of the attention core: skipped without a GPU (CI has none); run on a lent GPU machine."""
import pytest
import torch

from attnlab import GroupedQueryAttention, MultiHeadAttention, MultiHeadLatentAttention
from conftest import F64, randomize
from reference import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

MODULES = {
    "mha": lambda: MultiHeadAttention(64, 4, rope_base=10000.0),
    "gqa-strided": lambda: GroupedQueryAttention(64, 8, 2, bias=True),
    "gqa-blocked": lambda: GroupedQueryAttention(64, 8, 4, grouping="blocked", rope_base=500.0,
                                                 rope_interleaved=True),
    "mla": lambda: MultiHeadLatentAttention(64, 4, 24, head_dim=16, v_head_dim=8, rope_dim=8, latent_norm=True),
}


def _pair(name):
    """The same weights on the CPU in float64 and on CUDA in float32."""
    torch.manual_seed(0)
    cpu = randomize(MODULES[name]().to(F64), std=0.2)
    for norm in ("q_norm", "kv_norm"):
        if getattr(cpu, norm, None) is not None:
            with torch.no_grad():
                getattr(cpu, norm).weight.fill_(1.0)
    gpu = MODULES[name]().cuda()
    gpu.load_state_dict({k: v.float() for k, v in cpu.state_dict().items()})
    return cpu, gpu


@pytest.mark.parametrize("name", list(MODULES))
def test_cuda_matches_cpu_float64(name):
    cpu, gpu = _pair(name)
    x = torch.randn(2, 33, 64, dtype=F64)
    with torch.no_grad():
        exact = cpu(x, is_causal=True)
        got = gpu(x.float().cuda(), is_causal=True).cpu()
        # float32 with TF32 disabled: the same computation on the CPU in float32 sets the tolerance
        own = MODULES[name]().to(torch.float32)
        own.load_state_dict({k: v.float() for k, v in cpu.state_dict().items()})
        cpu32 = own(x.float(), is_causal=True)
    assert rel_err(got, exact) <= 10 * max(rel_err(cpu32, exact), 1e-7)


@pytest.mark.parametrize("name", list(MODULES))
def test_cuda_decode_equals_full_forward(name):
    _, gpu = _pair(name)
    x = torch.randn(1, 40, 64, device="cuda")
    cache = gpu.init_cache(1, 40)
    with torch.no_grad():
        full = gpu(x, is_causal=True)
        outs = [gpu(x[:, :30], cache=cache, is_causal=True)]
        outs += [gpu(x[:, t:t + 1], cache=cache, is_causal=True) for t in range(30, 40)]
    assert rel_err(torch.cat(outs, 1), full) <= 1e-5


def test_cuda_bfloat16_mla_absorbed():
    cpu, _ = _pair("mla")
    gpu = MODULES["mla"]().to("cuda", torch.bfloat16)
    gpu.load_state_dict({k: v.to(torch.bfloat16) for k, v in cpu.state_dict().items()})
    cpu.load_state_dict({k: v.to(torch.bfloat16).to(F64) for k, v in cpu.state_dict().items()})
    x = torch.randn(1, 16, 64, dtype=F64).to(torch.bfloat16)
    with torch.no_grad():
        exact = cpu(x.to(F64), is_causal=True)
        cache = gpu.init_cache(1, 16)
        outs = [gpu(x[:, :8].cuda(), cache=cache, is_causal=True)]
        outs += [gpu(x[:, t:t + 1].cuda(), cache=cache, is_causal=True, absorbed=True) for t in range(8, 16)]
    assert rel_err(torch.cat(outs, 1).cpu(), exact) <= 4 * torch.finfo(torch.bfloat16).eps
