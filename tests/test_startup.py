"""What importing attnlab and asking the command line for help load, and what `kv` prints
(times live in benchmarks/speed/cli_startup.py).

Each check runs in a fresh interpreter, since this one has long loaded everything.
"""
import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch._dynamo", "triton", "transformers", "matplotlib", "gguf", "safetensors")


def loaded_after(code: str, names=("torch", *HEAVY)) -> list[str]:
    """Which of `names` are in sys.modules after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([n for n in {list(names)!r} if n in sys.modules]))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_attnlab_loads_nothing_heavy():
    assert loaded_after("import attnlab") == []


def test_the_core_loads_torch_but_not_dynamo_or_extras():
    assert loaded_after("import attnlab.modules, attnlab.kernels, attnlab.convert") == ["torch"]


@pytest.mark.parametrize("argv", [["--help"], *([c, "--help"] for c in (
    "shrink", "tour", "kv", "bench", "convert", "heal", "export", "generate", "eval"))])
def test_help_loads_no_torch(argv):
    code = ("import contextlib, io\nfrom attnlab.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()) as out:\n    rc = main({argv!r})\n"
            "assert rc == 0 and 'Usage' in out.getvalue(), (rc, out.getvalue()[:200])")
    assert loaded_after(code) == []


def test_lazy_names_are_the_modules_own():
    import attnlab
    from attnlab.modules import attention, cache, gqa, mla, rope

    homes = {"attend": attention, "causal_mask": attention, "KVCache": cache, "LatentCache": cache,
             "GroupedQueryAttention": gqa, "MultiHeadAttention": gqa, "MultiHeadLatentAttention": mla,
             "RotaryEmbedding": rope}
    assert sorted(attnlab.__all__) == sorted(homes)
    for name, home in homes.items():
        assert getattr(attnlab, name) is getattr(home, name)
    star: dict = {}
    exec("from attnlab import *", star)
    assert {k: star[k] for k in homes} == {k: getattr(attnlab, k) for k in homes}
    with pytest.raises(AttributeError, match="no_such_name"):
        attnlab.no_such_name  # noqa: B018


def test_constant_mark_matches_torchs_own():
    """kernels.mla_decode marks its constant functions without importing dynamo; the mark must be the one
    torch.compiler.assume_constant_result sets (a torch that marks differently fails here)."""
    import torch

    from attnlab.kernels import mla_decode

    def ours():
        return 1

    def theirs():
        return 1

    before = set(vars(ours))
    mla_decode.constant_under_compile(ours)
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and set(vars(theirs)) - before
    for fn in (mla_decode.mode, mla_decode._triton_importable):
        assert {k: getattr(fn, k, None) for k in vars(theirs)} == vars(theirs)


def test_kv_answers_without_transformers():
    code = ("import contextlib, io\nfrom attnlab.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    assert main(['kv', 'llama-3-8b']) == 0")
    assert loaded_after(code, names=HEAVY) == []


def test_kv_prints_the_same_numbers_as_before():
    """`python -m attnlab kv llama-3-8b` against Llama-3-8B's own sizes, worked out here: 32 layers, 8 KV heads of
    128, keys and values, 2 bytes (bfloat16), context 4096."""
    layers, kv_heads, head_dim, context = 32, 8, 128, 4096
    per_token = 2 * layers * kv_heads * head_dim * 2  # 131072 bytes
    proc = subprocess.run([sys.executable, "-m", "attnlab", "kv", "llama-3-8b"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "KV cache, bfloat16, context 4096, batch 1" in proc.stdout
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in proc.stdout.splitlines() if "llama-3-8b" in line]
    assert rows == [["llama-3-8b", "gqa", str(2 * kv_heads * head_dim), str(per_token),
                     f"{per_token / 1024:.2f} KiB", f"{per_token * context / 2 ** 20:.2f} MiB",
                     f"{per_token / 1024:.2f} KiB"]]  # held per token: the same, no layer slides
    assert rows[0][-3:] == ["128.00 KiB", "512.00 MiB", "128.00 KiB"]
