"""CUDA paths: the attention core, healing and shrink. Skipped without a GPU (CI has none); run on a lent GPU machine
(scripts/device_protocol.sh tests)."""
import math

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


@pytest.mark.parametrize("variant", ["gqa", "mla-exact", "mla-compressed"])
def test_cuda_graph_generation_equals_the_eager_loop(variant):
    """The decode step captured as a CUDA graph (Generator's default on CUDA: fixed shape, torch.compile
    reduce-overhead) gives the eager loop's logits on the same GPU, replayed over several steps and after a
    second prefill. Tolerance: float32 with TF32 off, the eager step's own difference from the fixed-shape
    eager step (more keys, masked) times 10, floored at 1e-5 (as tests/test_generate.py's FIXED_TOL)."""
    transformers = pytest.importorskip("transformers")
    from attnlab.generation.generator import Generator
    from attnlab.models import convert_model, to_attnlab

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    model = to_attnlab(transformers.LlamaForCausalLM(config).eval())
    if variant != "gqa":
        convert_model(model, "mla", **({"latent_dim": 40, "rope_dim": 8} if variant == "mla-compressed" else {}))
    model = model.cuda()
    ids = torch.randint(3, 100, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :6] = 0
    eager = Generator(model, 3, 24, fixed_shape=False, compile=False)
    fixed = Generator(model, 3, 24, fixed_shape=True, compile=False)
    graph = Generator(model, 3, 24)
    assert graph.fixed_shape and graph.compiled
    with torch.no_grad():
        for rows in (slice(0, 3), slice(0, 3)):  # the second prefill replays the captured graph
            a, f, g = (gen.prefill(ids[rows], mask[rows]) for gen in (eager, fixed, graph))
            for _ in range(8):
                nxt = a.argmax(-1)
                a, f, g = eager.step(nxt), fixed.step(nxt), graph.step(nxt)
                tol = 10 * max(((a - f).norm() / a.norm()).item(), 1e-6)
                assert ((g - a).norm() / a.norm()).item() <= max(tol, 1e-5)
                assert torch.equal(g.argmax(-1), a.argmax(-1))


# -- healing and shrinking on CUDA (bf16 autocast): the paths a --device cuda user runs ----------------------------
T = 16  # tokens per window of the tiny model


def _tiny(tmp_path):
    from tiny_checkpoints import make_checkpoint

    from attnlab import models as hf

    folder = tmp_path / "llama"
    make_checkpoint("llama", folder, initializer_range=0.3, max_position_embeddings=512)
    return folder, hf.load_model(str(folder))[0]


def test_cuda_heal_lowers_the_distillation_loss_on_held_out_windows(tmp_path):
    """heal_model on the GPU (bf16 autocast, both phases) lowers the distillation loss on windows it never trained
    on, scored afterwards on the CPU in float32; the teacher's weights stay as they were."""
    import copy

    from attnlab import models as hf
    from attnlab.heal import HealPlan, distill_loss, heal_model

    _, teacher = _tiny(tmp_path)
    student = copy.deepcopy(teacher)
    hf.convert_model(student, "mla", latent_dim=12, rope_dim=4)
    windows = [torch.randint(0, 300, (n, T), generator=torch.Generator().manual_seed(s)) for n, s in ((32, 0), (8, 9))]
    before = distill_loss(teacher, student, windows[1])
    frozen = copy.deepcopy(teacher.state_dict())
    plan = HealPlan(seq_len=T, batch_size=4, tokens=4 * T * 12, layer_steps=6, layer_windows=8, layer_batch=4,
                    layer_lr=1e-3, lr=2e-3, warmup=2)
    report = heal_model(teacher, student, windows[0], windows[1].reshape(1, -1), plan, device="cuda",
                        keep_better=False)
    assert report["status"] == "done" and report["device"].startswith("cuda")
    teacher.cpu(), student.cpu()
    assert distill_loss(teacher, student, windows[1]) < before
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in frozen.items())


def test_cuda_shrink_plans_heals_and_writes_a_model_that_loads(tmp_path, monkeypatch):
    """The shrink pipeline with device="cuda" on a budget in minutes: its heal plan times a layer step on the GPU (the
    queue drained before each reading), the heal runs there, and the written model loads and scores finitely on the
    CPU."""
    from tiny_checkpoints import TEXT

    from attnlab import models as hf
    from attnlab.shrink import ShrinkRequest, shrink

    folder, _ = _tiny(tmp_path)
    text = tmp_path / "train.txt"
    text.write_text(TEXT * 40)
    held = tmp_path / "held.txt"
    held.write_text(TEXT[::-1] * 8)
    drained = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (drained.append(a), real(*a))[1])
    out = tmp_path / "out"
    report = shrink(ShrinkRequest(source=str(folder), kv_budget="50%", out=str(out), minutes=1.5, seq_len=T,
                                  windows=16, text=[str(text)], eval_text=[str(held)], device="cuda"))
    assert drained and report["heal"]["device"].startswith("cuda") and report["heal"]["steps_done"] > 0
    model, tok, _ = hf.load_model(str(out))
    ids = hf.read_text_ids(tok, str(held), 64)
    assert math.isfinite(hf.perplexity(model, ids, window=T))
