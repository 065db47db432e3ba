"""The Triton absorbed-MLA decode kernel (attnlab.kernels.mla_decode) and its PyTorch twin.

Three groups:
- the twin and the module's dispatch, in this process (no triton needed): the twin
  against the naive oracle in float64, ragged lengths and key padding as invariants,
  bad input, when the module hands a step to the kernel;
- the kernel in triton's CPU interpreter: triton reads TRITON_INTERPRET once, when it
  is imported, for the whole process. Setting it here would turn every later triton
  import of the test run (GPU tests, torch.compile) into the interpreter, so these tests
  run only in a child pytest started by `test_interpreted_kernel_tests` with
  TRITON_INTERPRET=1 (or directly: `TRITON_INTERPRET=1 pytest tests/test_kernels.py`);
- the kernel compiled on a GPU: skipped without CUDA.
Quantised caches (modules/cache.py: int8 or float8_e4m3fn codes with float32 scales, which the kernel
dequantises in its tile load) run through the interpreter and GPU groups too.

Tolerances (float32, bfloat16) are what the dtype achieves on the same computation:
the PyTorch path (the twin, or the module's existing absorbed path) in that dtype
against the float64 twin on the same rounded inputs, times a stated factor of 3 for
what the kernel rounds besides: a different summation order, one more rescaling when the
split partials merge, and on a GPU the hardware's approximate exp2 (a few ulp); floored
at the dtype's unit roundoff. (A factor of 2 failed on an H200 for float32 int8 caches,
the kernel's error 2.004 times the twin's, 2026-11-26.)
"""
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from attnlab import MultiHeadLatentAttention
from attnlab.kernels import absorbed_decode, absorbed_decode_reference, mla_decode
from conftest import F64, randomize
from reference import attend_naive, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRETED),
    reason="runs in the TRITON_INTERPRET=1 child started by test_interpreted_kernel_tests")
on_gpu = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()) or INTERPRETED,
                            reason="needs CUDA and triton (compiled, not interpreted)")
FACTOR = 3  # kernel error <= FACTOR * (the PyTorch path's error in the same dtype), see the module docstring
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def tolerance(dtype, *pytorch_errors) -> float:
    return FACTOR * max([UNIT[dtype], *pytorch_errors])


def _inputs(B, H, S, r, p, dtype=F64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, r + p, generator=g, dtype=F64)  # (B, H, r+p)
    kv = torch.randn(B, S, r + p, generator=g, dtype=F64)  # (B, S, r+p)
    return q.to(device, dtype), kv.to(device, dtype)


def _ragged(B, S, seed=1):
    """Per-row lengths (row 0 full, the others cut short) and a random key-padding mask with left
    padding (row b hides its first 2b keys); every row keeps at least its last key."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([S - (b * 7) % max(S // 2, 1) for b in range(B)])
    keep = torch.rand(B, S, generator=g) > 0.25
    for b in range(B):
        keep[b, : 2 * b] = False
        keep[b, lengths[b] - 1] = True
    return lengths, keep


# -- the twin, in float64, against the naive oracle and as invariants ---------------------------------
def test_twin_equals_naive_oracle_float64():
    B, H, S, r, p = 2, 3, 11, 6, 4
    q, kv = _inputs(B, H, S, r, p)
    lengths, keep = _ragged(B, S)
    scale = 0.37
    got = absorbed_decode_reference(q, kv, lengths, scale, r, keep)  # (B, H, r)
    allowed = lambda b, h, l1, j: bool(j < lengths[b] and keep[b, j])  # noqa: E731
    ref = attend_naive([[[q[b, h]] for h in range(H)] for b in range(B)],
                       [[list(kv[b])] for b in range(B)], [[list(kv[b, :, :r])] for b in range(B)],
                       [0] * H, allowed, scale)
    ref = torch.stack([ref[b][0].view(H, r) for b in range(B)])  # (B, H, r)
    assert rel_err(got, ref) <= 1e-10


def test_twin_lengths_and_padding_equal_shorter_caches():
    """Row b with length n and padding equals the same row with only its kept rows, exactly (float64)."""
    B, H, S, r, p = 3, 2, 20, 8, 4
    q, kv = _inputs(B, H, S, r, p)
    lengths, keep = _ragged(B, S)
    got = absorbed_decode_reference(q, kv, lengths, 0.5, r, keep)
    for b in range(B):
        rows = torch.nonzero(keep[b, : lengths[b]])[:, 0]
        alone = absorbed_decode_reference(q[b:b + 1], kv[b:b + 1, rows], len(rows), 0.5, r)
        assert rel_err(got[b:b + 1], alone) <= 1e-10


def test_twin_head_with_nothing_to_attend_gives_zeros():
    q, kv = _inputs(2, 2, 9, 4, 2)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1] = False
    out = absorbed_decode_reference(q, kv, torch.tensor([9, 0]), 1.0, 4, keep)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0


@pytest.mark.parametrize("bad, error, words", [
    (dict(lengths=10), ValueError, "0..9"),
    (dict(lengths=torch.tensor([1, 2, 3])), ValueError, "(2,)"),
    (dict(lengths=torch.tensor([1.0, 2.0])), TypeError, "integer tensor"),
    (dict(latent_dim=7), ValueError, "1..6"),
    (dict(key_padding_mask=torch.ones(2, 8, dtype=torch.bool)), ValueError, "(2, 9)"),
    (dict(key_padding_mask=torch.ones(2, 9)), TypeError, "bool"),
    (dict(q=torch.zeros(2, 3, 5)), ValueError, "(2, H, 6)"),
    (dict(q=torch.zeros(2, 3, 6, dtype=torch.float16)), TypeError, "torch.float16"),
])
@pytest.mark.parametrize("fn", [absorbed_decode_reference, absorbed_decode])
def test_bad_input_names_the_values(fn, bad, error, words):
    q, kv = _inputs(2, 3, 9, 4, 2, dtype=torch.float32)
    args = dict(q=q, kv=kv, lengths=9, scale=1.0, latent_dim=4, key_padding_mask=None)
    args.update(bad)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        fn(**args)


def test_bad_env_var_names_it(monkeypatch):
    monkeypatch.setenv(mla_decode.ENV, "cuda")
    with pytest.raises(ValueError, match="ATTNLAB_MLA_DECODE must be one of auto, torch, triton, got 'cuda'"):
        mla_decode.mode()


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="checks the refusal on a plain CPU process")
def test_kernel_refuses_cpu_tensors_without_interpreter():
    if not HAS_TRITON:
        pytest.skip("triton not installed")
    q, kv = _inputs(1, 2, 5, 4, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs CUDA tensors, got cpu"):
        absorbed_decode(q, kv, 5, 1.0, 4)


# -- the module's dispatch -----------------------------------------------------------------------
def _mla(bias=False, rope_dim=4, dtype=F64):
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(32, 4, 12, head_dim=8, v_head_dim=6, rope_dim=rope_dim, latent_norm=True,
                                 bias=bias)
    return randomize(m, std=0.3).to(dtype)


def _decode_steps(m, x, prompt, pad=None):
    """Prefill `prompt` tokens, then decode the rest one by one; outputs (B, L, dim)."""
    B, L, _ = x.shape
    cache = m.init_cache(B, L)
    kw = lambda n: {} if pad is None else dict(key_padding_mask=pad[:, :n])  # noqa: E731
    with torch.no_grad():
        outs = [m(x[:, :prompt], cache=cache, is_causal=True, **kw(prompt))]
        outs += [m(x[:, t:t + 1], cache=cache, **kw(t + 1)) for t in range(prompt, L)]
    return torch.cat(outs, 1)


def _left_padding(B, L):
    pad = torch.ones(B, L, dtype=torch.bool)
    for b in range(B):
        pad[b, : 2 * b] = False
    return pad


@pytest.mark.parametrize("bias", [False, True])
def test_module_dispatch_through_twin_equals_expanded_float64(monkeypatch, bias):
    """With the kernel replaced by its twin, decode through the dispatch == the expanded path, exactly.
    With a value bias on W_UV the dispatch must leave the step to the PyTorch path."""
    calls = []

    def twin(*args, **kw):
        calls.append(1)
        return absorbed_decode_reference(*args, **kw)

    monkeypatch.setattr(mla_decode, "absorbed_decode", twin)
    monkeypatch.setenv(mla_decode.ENV, "triton")
    m = _mla(bias=bias)
    x = torch.randn(3, 10, 32, dtype=F64)
    pad = _left_padding(3, 10)
    got = _decode_steps(m, x, 6, pad)
    with torch.no_grad():
        full = m(x, is_causal=True, key_padding_mask=pad, absorbed=False)
    assert rel_err(got, full) <= 1e-10
    assert len(calls) == (0 if bias else 4)


@pytest.mark.parametrize("shape", [(1, 9), (2, 1, 9), (1, 1, 9), (2, 1, 1, 9), (1, 1, 1, 9)])
def test_dispatch_reads_key_masks_of_every_layout(monkeypatch, shape):
    """Bool masks that hide keys only, in each layout the attention core accepts, reach the kernel
    (here its twin) as the (B, S) mask they mean."""
    monkeypatch.setattr(mla_decode, "absorbed_decode", absorbed_decode_reference)
    monkeypatch.setenv(mla_decode.ENV, "triton")
    q, kv = _inputs(2, 3, 9, 4, 2)
    _, keep = _ragged(2, 9)
    mask = keep[: shape[0]].reshape(shape)
    got = mla_decode.try_decode(q[:, :, None], kv, mask, 0.7, 4)[:, :, 0]  # (B, H, r)
    want = absorbed_decode_reference(q, kv, 9, 0.7, 4, keep[: shape[0]].expand(2, 9))
    assert torch.equal(got, want)


def test_dispatch_declines_what_the_kernel_does_not_do(monkeypatch):
    monkeypatch.setenv(mla_decode.ENV, "triton")
    q, kv = _inputs(2, 3, 9, 4, 2, dtype=torch.float32)
    q4 = q[:, :, None]  # (B, H, 1, r+p)
    per_head = torch.ones(2, 3, 1, 9, dtype=torch.bool)
    assert mla_decode.try_decode(torch.cat([q4, q4], 2), kv, None, 1.0, 4) is None  # two query rows
    assert mla_decode.try_decode(q4, kv, torch.zeros(2, 1, 1, 9), 1.0, 4) is None  # a float mask
    assert mla_decode.try_decode(q4, kv, per_head, 1.0, 4) is None  # a mask per head
    with torch.enable_grad():
        assert mla_decode.try_decode(q4.requires_grad_(), kv, None, 1.0, 4) is None  # autograd
    monkeypatch.setenv(mla_decode.ENV, "torch")
    assert mla_decode.try_decode(q, kv, None, 1.0, 4) is None
    monkeypatch.setenv(mla_decode.ENV, "auto")
    assert mla_decode.try_decode(q4, kv, None, 1.0, 4) is None  # CPU tensors: the PyTorch path
    assert mla_decode.available(q) == (q.is_cuda and HAS_TRITON)
    assert mla_decode.available(q, interpret=True) == (HAS_TRITON and INTERPRETED)


@pytest.mark.parametrize("rows, splits", [(100, None), (4096, None), (4096, 3), (33, 5), (1, None)])
def test_plan_covers_every_row_once(rows, splits):
    g = mla_decode.plan(1, 16, rows, 512, torch.device("cpu"), splits)
    assert g["chunk"] % g["BN"] == 0 and g["num_splits"] * g["chunk"] >= rows
    assert (g["num_splits"] - 1) * g["chunk"] < rows  # no split starts past the end


def test_benchmark_without_cuda_says_so_and_exits_cleanly():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run for real")
    here = Path(__file__).parent.parent
    run = subprocess.run([sys.executable, str(here / "benchmarks" / "speed" / "decode_kernel.py"), "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "needs a CUDA device" in run.stdout, run.stdout + run.stderr


# -- the kernel in triton's interpreter ---------------------------------------------------------------
@pytest.mark.slow  # one child pytest for all the interpreter tests: ~10 s of imports and interpreted kernels
@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="this is the parent; needs triton")
def test_interpreted_kernel_tests():
    """Run this file's interpreter tests in a child pytest with TRITON_INTERPRET=1 (see the docstring)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("ATTNLAB_MLA_DECODE", None)
    here = Path(__file__)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(here),
                          "-k", "interpreted and not test_interpreted_kernel_tests"],
                         cwd=here.parent.parent, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]


CASES = [  # (B, H, S, r, p, num_splits): S off the tile size, H off the head block, r off a power of two
    (1, 4, 37, 16, 16, None),
    (2, 3, 50, 24, 8, 2),
    (1, 5, 130, 32, 0, 3),
    (3, 2, 21, 20, 4, 1),
    (1, 17, 70, 16, 16, 4),
]


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}H{c[1]}S{c[2]}r{c[3]}p{c[4]}T{c[5]}" for c in CASES])
def test_interpreted_kernel_matches_twin(case, dtype):
    B, H, S, r, p, splits = case
    q, kv = _inputs(B, H, S, r, p, dtype=dtype)
    lengths, keep = _ragged(B, S)
    scale = (r + p) ** -0.5
    exact = absorbed_decode_reference(q.double(), kv.double(), lengths, scale, r, keep)  # same rounded inputs
    twin = absorbed_decode_reference(q, kv, lengths, scale, r, keep)
    got = absorbed_decode(q, kv, lengths, scale, r, keep, num_splits=splits, block_n=16)
    assert got.dtype == dtype and got.shape == (B, H, r)
    assert rel_err(got, exact) <= tolerance(dtype, rel_err(twin, exact))


@interpreted_only
def test_interpreted_empty_splits_and_masked_heads():
    """Splits that hold no kept key, and a row with none at all (zeros), through the combine step."""
    q, kv = _inputs(2, 3, 64, 16, 16, dtype=torch.float32)
    keep = torch.zeros(2, 64, dtype=torch.bool)
    keep[0, 40:44] = True  # only the third of four splits sees anything
    lengths = torch.tensor([64, 64])
    got = absorbed_decode(q, kv, lengths, 0.3, 16, keep, num_splits=4, block_n=16)
    exact = absorbed_decode_reference(q.double(), kv.double(), lengths, 0.3, 16, keep)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert rel_err(got[0], exact[0]) <= tolerance(torch.float32)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_interpreted_module_decode_kernel_equals_pytorch_path(monkeypatch, dtype):
    """A left-padded batch decoded by the module: kernel path == existing PyTorch absorbed path,
    both measured against the float64 module (whose expanded path equals its absorbed one)."""
    m64 = _mla()
    m = _mla(dtype=dtype)
    m.load_state_dict({k: v.to(dtype) for k, v in m64.state_dict().items()})
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})  # the same rounded weights
    x = torch.randn(3, 9, 32, dtype=F64).to(dtype)
    pad = _left_padding(3, 9)
    monkeypatch.setenv(mla_decode.ENV, "torch")
    exact = _decode_steps(m64, x.double(), 5, pad)
    torch_path = _decode_steps(m, x, 5, pad)
    monkeypatch.setenv(mla_decode.ENV, "triton")
    kernel_path = _decode_steps(m, x, 5, pad)
    steps = slice(5, None)  # the decode steps (the prompt goes through the PyTorch path either way)
    real = pad[:, steps, None].expand_as(exact[:, steps])  # padded query rows have no keys before them
    e_kernel = rel_err(kernel_path[:, steps][real], exact[:, steps][real])
    e_torch = rel_err(torch_path[:, steps][real], exact[:, steps][real])
    assert e_kernel <= tolerance(dtype, e_torch)
    with torch.no_grad():
        expanded = m64(x.double(), is_causal=True, key_padding_mask=pad, absorbed=False)
    assert rel_err(exact[:, steps][real], expanded[:, steps][real]) <= 1e-10


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="compiles with triton's real compiler")
@pytest.mark.parametrize("H, r, p, dtype, quant, group", [
    (16, 512, 64, "bf16", 0, None), (32, 256, 64, "bf16", 0, None), (16, 512, 64, "fp32", 0, None),
    (16, 512, 64, "bf16", 1, None), (16, 512, 64, "bf16", 2, None), (16, 512, 64, "fp32", 1, None),
    (16, 512, 64, "fp32", 2, None), (16, 512, 64, "bf16", 1, 32), (32, 256, 64, "bf16", 2, 32)])
def test_kernel_compiles_for_hopper_without_spills(H, r, p, dtype, quant, group):
    """No GPU needed: triton compiles to PTX and its bundled ptxas assembles for sm_90a. The launch must
    fit an H100 (shared memory <= 227 KiB per block) and keep its accumulators in registers (no spills).
    Integers are marked divisible by 16 as triton's launcher specialises them for these sizes.
    quant 1/2: an int8 / float8_e4m3fn cache (codes as bytes) dequantised in the tile load, with one scale
    per part of a row or per `group` channels."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        pytest.skip("triton without its NVIDIA backend")
    from attnlab.kernels import mla_decode_triton as K

    size = 4 if dtype == "fp32" else 2
    row_bytes = (r + p) + 8 if quant else size * (r + p)
    g = mla_decode.plan(1, H, 32768, r, torch.device("cpu"), row_bytes=row_bytes, element_size=size,
                        quantised=bool(quant))
    names = list(inspect.signature(K.split_kernel.fn).parameters)
    ptrs = dict(Q="*" + dtype, KV="*" + ({1: "i8", 2: "u8"}.get(quant, dtype)), SCALES="*fp32" if quant else "*i32",
                LENGTHS="*i32", KEEP="*u8", OUT="*" + dtype, M_PART="*fp32", L_PART="*fp32", ACC_PART="*fp32")
    consts = dict(BH=g["BH"], BN=g["BN"], BR=g["BR"], BP=p, HAS_ROPE=True, HAS_KEEP=True, SPLIT=True, QUANT=quant,
                  GR=group or g["BR"], GP=group or p, PRECISION="ieee" if dtype == "fp32" else "tf32", DOT_F32=False)
    signature = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "qk_scale" else "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n in ptrs or n in ("chunk", "latent_dim", "rope_dim", "num_heads")
               or (n.startswith("stride_") and n not in ("stride_keepb", "stride_ss"))}
    k = triton.compile(ASTSource(fn=K.split_kernel, signature=signature, constexprs=consts, attrs=aligned),
                       target=GPUTarget("cuda", 90, 128), options=dict(num_warps=g["num_warps"], num_stages=g["num_stages"]))
    assert k.metadata.shared <= 227 * 1024
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(k.asm["ptx"])
        run = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(ptx) + ".cubin"],
                             capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "0 bytes spill stores, 0 bytes spill loads" in run.stderr, run.stderr[-2000:]


@interpreted_only
def test_interpreted_dispatch_compiles_without_graph_break(monkeypatch):
    """Under torch.compile the kernel is an opaque operator (attnlab::mla_absorbed_decode): the whole
    dispatch traces as one graph, so a compiled decode step (CUDA graphs) keeps it, and it computes the same."""
    monkeypatch.setenv(mla_decode.ENV, "triton")
    torch._dynamo.reset()
    q, kv = _inputs(2, 3, 40, 16, 8, dtype=torch.float32)
    _, keep = _ragged(2, 40)
    step = torch.compile(lambda q, kv, mask: mla_decode.try_decode(q, kv, mask, 0.3, 16),
                         fullgraph=True, backend="eager")
    got = step(q[:, :, None], kv, keep[:, None, None, :])[:, :, 0]  # (B, H, r)
    exact = absorbed_decode_reference(q.double(), kv.double(), 40, 0.3, 16, keep)
    twin = absorbed_decode_reference(q, kv, 40, 0.3, 16, keep)
    assert rel_err(got, exact) <= tolerance(torch.float32, rel_err(twin, exact))


# -- quantised caches (modules/cache.py: int8 / fp8 codes + float32 scales) in the interpreter --------
QUANT_CASES = [  # (B, H, S, r, p, kv_dtype, q dtype, splits): r, p off powers of two, groups inside and across parts
    (2, 3, 50, 24, 8, "int8", torch.float32, 2),
    (1, 5, 37, 20, 6, "int8/g8", torch.bfloat16, 1),
    (2, 17, 70, 16, 16, "fp8", torch.bfloat16, 3),
    (1, 4, 33, 12, 0, "fp8/g4", torch.float32, 2),
    (1, 4, 40, 20, 12, "int8/g64", torch.float32, 1),
]


def _quantised_inputs(B, H, S, r, p, kv_dtype, dtype, device="cpu", seed=5):
    """q, the codes and scales of a cache whose rope part is 9x its latent's size, and the storage format."""
    from attnlab.modules.storage import check_kv_dtype, quantise

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, r + p, generator=g).to(device, dtype)
    kv = torch.cat([torch.randn(B, S, r, generator=g), 9 * torch.randn(B, S, p, generator=g)], -1).to(device)
    fmt = check_kv_dtype(kv_dtype)
    codes, scales = quantise(kv, (r, p) if p else (r,), fmt)
    return q, codes, scales, fmt


@interpreted_only
@pytest.mark.parametrize("case", QUANT_CASES, ids=[f"{c[5]}-{str(c[6])[6:]}" for c in QUANT_CASES])
def test_interpreted_kernel_reads_quantised_cache(case):
    """The kernel on codes + scales (dequantised in its tile load) against the float64 twin on the same codes
    (dequantised in float64): within the tolerance above, from the float32/bfloat16 twin's own error."""
    B, H, S, r, p, kv_dtype, dtype, splits = case
    q, codes, scales, fmt = _quantised_inputs(B, H, S, r, p, kv_dtype, dtype)
    keep = torch.rand(B, S, generator=torch.Generator().manual_seed(7)) > 0.2
    keep[:, 0] = True
    lengths = torch.tensor([S - 5 * b for b in range(B)])
    kw = dict(kv_scales=scales, scale_group=fmt.group)
    exact = absorbed_decode_reference(q.double(), codes, lengths, 0.3, r, keep, **kw)
    twin = absorbed_decode_reference(q, codes, lengths, 0.3, r, keep, **kw)
    got = absorbed_decode(q, codes, lengths, 0.3, r, keep, num_splits=splits, block_n=16, **kw)
    assert got.dtype == dtype
    assert rel_err(got, exact) <= tolerance(dtype, rel_err(twin, exact))


@interpreted_only
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_interpreted_module_decode_on_quantised_cache_equals_pytorch_path(monkeypatch, kv_dtype):
    """Decode steps of an MLA with a quantised cache: the kernel (handed the codes and scales) == the PyTorch
    absorbed path (which dequantises the cache first), both float32; the same values summed in another
    order (sums of at most 16 terms): 64 float32 epsilons."""
    m = _mla(dtype=torch.float32)
    x = torch.randn(2, 8, 32)
    outs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv(mla_decode.ENV, mode)
        cache = m.init_cache(2, 8, kv_dtype=kv_dtype)
        with torch.no_grad():
            outs[mode] = torch.cat([m(x[:, t:t + 1], cache=cache, absorbed=True) for t in range(8)], 1)
    assert rel_err(outs["triton"], outs["torch"]) <= 64 * torch.finfo(torch.float32).eps


# -- the kernel compiled on a GPU ---------------------------------------------------------------------
GPU_CASES = [  # DeepSeek-like latent (r 512, p 64) and attnlab's compressed presets (r 256 / 128)
    (1, 16, 8193, 512, 64, None),
    (4, 32, 3000, 256, 64, None),
    (2, 9, 2049, 128, 32, 7),
    (8, 128, 1025, 512, 64, None),
]


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"B{c[0]}H{c[1]}S{c[2]}r{c[3]}" for c in GPU_CASES])
def test_gpu_kernel_matches_twin(case, dtype):
    B, H, S, r, p, splits = case
    q, kv = _inputs(B, H, S, r, p, dtype=dtype, device="cuda")
    lengths, keep = _ragged(B, S)
    lengths, keep = lengths.cuda(), keep.cuda()
    scale = (r + p) ** -0.5
    exact = absorbed_decode_reference(q.double(), kv.double(), lengths, scale, r, keep)
    twin = absorbed_decode_reference(q, kv, lengths, scale, r, keep)
    got = absorbed_decode(q, kv, lengths, scale, r, keep, num_splits=splits)
    assert rel_err(got, exact) <= tolerance(dtype, rel_err(twin, exact))


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_module_decode_kernel_equals_pytorch_path(monkeypatch, dtype):
    m64 = _mla()
    m = _mla(dtype=dtype).cuda()
    m.load_state_dict({k: v.to(dtype) for k, v in m64.state_dict().items()})
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    x = torch.randn(3, 40, 32, dtype=F64).to(dtype)
    pad = _left_padding(3, 40)
    monkeypatch.setenv(mla_decode.ENV, "torch")
    exact = _decode_steps(m64, x.double(), 20, pad)
    torch_path = _decode_steps(m, x.cuda(), 20, pad.cuda()).cpu()
    monkeypatch.setenv(mla_decode.ENV, "auto")  # the default on CUDA is the kernel
    kernel_path = _decode_steps(m, x.cuda(), 20, pad.cuda()).cpu()
    real = pad[:, 20:, None].expand_as(exact[:, 20:])
    e_kernel = rel_err(kernel_path[:, 20:][real], exact[:, 20:][real])
    assert e_kernel <= tolerance(dtype, rel_err(torch_path[:, 20:][real], exact[:, 20:][real]))


@on_gpu
def test_gpu_kernel_in_cuda_graph_reads_lengths_at_replay():
    """A static buffer and a lengths tensor: one captured launch serves every step."""
    q, kv = _inputs(1, 16, 4096, 512, 64, dtype=torch.bfloat16, device="cuda")
    lengths = torch.tensor([100], device="cuda")
    absorbed_decode(q, kv, lengths, 0.1, 512)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = absorbed_decode(q, kv, lengths, 0.1, 512)
    for n in (100, 2000, 4096):
        lengths.fill_(n)
        graph.replay()
        exact = absorbed_decode_reference(q.double(), kv.double(), n, 0.1, 512)
        twin = absorbed_decode_reference(q, kv, n, 0.1, 512)
        assert rel_err(out, exact) <= tolerance(torch.bfloat16, rel_err(twin, exact))


@on_gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "int8/g32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_kernel_reads_quantised_cache(kv_dtype, dtype):
    """DeepSeek-like rows (r 512, p 64) from an int8 / fp8 cache, against the float64 twin on the same codes."""
    B, H, S, r, p = 2, 16, 3001, 512, 64
    q, codes, scales, fmt = _quantised_inputs(B, H, S, r, p, kv_dtype, dtype, device="cuda")
    lengths = torch.tensor([S, S - 1000], device="cuda")
    kw = dict(kv_scales=scales, scale_group=fmt.group)
    exact = absorbed_decode_reference(q.double(), codes, lengths, (r + p) ** -0.5, r, **kw)
    twin = absorbed_decode_reference(q, codes, lengths, (r + p) ** -0.5, r, **kw)
    got = absorbed_decode(q, codes, lengths, (r + p) ** -0.5, r, **kw)
    assert rel_err(got, exact) <= tolerance(dtype, rel_err(twin, exact))
