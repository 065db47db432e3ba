"""The package's layering (docs/architecture.md), read from the source: imports point down, never in a circle,
the core is free of the extras, and every documented import path still works.

The rule, from the bottom up (a package may import those on lower floors, never a higher one
and never a sibling on its own floor):
    kernels < modules < convert, io, runtime < study, models < generation, hf < heal, bench < shrink < cli
Imports inside functions count as much as those at the top of a file: a lazy import that
climbs is still a climb.
"""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "attnlab"
ROOT = SRC.parent.parent
FLOORS = [("kernels",), ("modules",), ("convert", "io", "runtime"), ("study", "models"), ("generation", "hf"),
          ("heal", "bench"), ("shrink",), ("cli",)]
RANK = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}
EXTRAS = ("transformers", "typer", "rich", "matplotlib", "triton", "gguf", "peft", "safetensors", "llama_cpp",
          "accelerate", "click", "tokenizers")
TOP_FILES = {"__init__": -1, "__main__": len(FLOORS)}  # the root's own files


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path):
    """(target module, line, at module level?) for every import of an attnlab module in the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names if a.name.split(".")[0] == "attnlab"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "attnlab":
                continue
            if node.module is None or target in ("attnlab",):  # from . import x: x may be a module
                out += [(f"{target}.{a.name}", node.lineno, id(node) in top) for a in node.names]
            else:
                out.append((target, node.lineno, id(node) in top))
    return out


def extras_at_module_level(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in tree.body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [(n, node.lineno) for n in names if n.split(".")[0] in EXTRAS]
    return found


def floor_of(module: str):
    """(package, rank) of an attnlab module: its subpackage, or the root's own file."""
    parts = module.split(".")
    if len(parts) == 1:
        return "attnlab", -1
    head = parts[1]
    if head in RANK:
        return head, RANK[head]
    if head in TOP_FILES:
        return head, TOP_FILES[head]
    raise AssertionError(f"{module} is in no floor of the layering: add its package to FLOORS (and the docs)")


def files():
    return sorted(SRC.rglob("*.py"))


def layering_violations(paths) -> list[str]:
    bad = []
    for path in paths:
        me = module_name(path)
        pkg, rank = floor_of(me)
        for target, line, _ in imports(path):
            tpkg, trank = floor_of(target)
            if me == "attnlab" and tpkg == "modules":  # the root re-exports the core
                continue
            if trank > rank or (trank == rank and tpkg != pkg):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {pkg} (floor {rank}) imports {target} "
                           f"({tpkg}, floor {trank})")
    return bad


def test_every_package_is_on_a_floor_and_named_in_the_architecture_map():
    packages = sorted(p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(RANK) == packages
    arch = (ROOT / "docs" / "architecture.md").read_text()
    for pkg in packages:
        assert re.search(rf"^{pkg}/", arch, re.M), f"docs/architecture.md's folder map lacks {pkg}/"


def test_imports_point_down_and_never_to_a_sibling():
    assert layering_violations(files()) == []


def test_the_check_catches_a_climbing_import(tmp_path):
    """The rule is live: a core module that imports the generation loop (as decoder.py's old home did) fails it."""
    bad = SRC / "modules" / "_climb_probe.py"
    bad.write_text("from ..generation.loop import generate\n")
    try:
        found = layering_violations([bad])
    finally:
        bad.unlink()
    assert len(found) == 1 and "modules (floor 1) imports attnlab.generation.loop" in found[0]


def test_no_import_cycle_between_modules():
    graph = {module_name(p): {t for t, _, top in imports(p) if top} for p in files()}
    known = set(graph)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            t = t if t in known else t.rpartition(".")[0] if t.rpartition(".")[0] in known else t
            if t not in known:
                continue
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_core_imports_no_extra_at_module_level():
    bad = []
    for path in files():
        pkg, _ = floor_of(module_name(path))
        allowed = {"typer", "rich", "click"} if pkg == "cli" else {"triton"} if path.name.endswith("_triton.py") else set()
        bad += [f"{path.relative_to(ROOT)}:{line} imports {name}" for name, line in extras_at_module_level(path)
                if name.split(".")[0] not in allowed]
    assert bad == []


BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {extras!r}:
            raise ImportError(f"blocked extra {{name}}")
sys.meta_path.insert(0, Block())
import torch
import attnlab, attnlab.modules, attnlab.convert, attnlab.io, attnlab.runtime, attnlab.kernels, attnlab.study.tour
import attnlab.study.usaaio
import attnlab.models, attnlab.generation, attnlab.heal, attnlab.bench
from attnlab import GroupedQueryAttention
from attnlab.convert import gqa_to_mla
gqa = GroupedQueryAttention(32, 4, 2, rope_base=1e4, dtype=torch.float64)
mla, report = gqa_to_mla(gqa)
x = torch.randn(1, 5, 32, dtype=torch.float64)
err = float((mla(x, is_causal=True) - gqa(x, is_causal=True)).norm() / gqa(x, is_causal=True).norm())
print(report.exact, err)
"""


def test_the_library_imports_and_runs_with_every_extra_missing():
    """Core, conversions, models, generation, heal and bench import with no extra installed (each extra is
    imported where it is used); the core converts and runs."""
    proc = subprocess.run([sys.executable, "-c", BLOCKER.format(extras=set(EXTRAS))], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    exact, err = proc.stdout.split()
    assert exact == "True" and float(err) <= 1e-10


# -- documented import paths ----------------------------------------------------------------------
def documented_paths() -> set[tuple[str, str | None]]:
    """(module, name or None) of every `from attnlab... import a, b` and `attnlab.x.y` in the README and docs."""
    found = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for mod, names in re.findall(r"from (attnlab[\w.]*) import ([\w, ]+)", text):
            found |= {(mod, n.split(" as ")[0].strip()) for n in names.split(",") if n.strip() and n.strip() != "*"}
        for dotted in re.findall(r"`(attnlab(?:\.\w+)+)", text):
            found.add((dotted, None))
    return found


def resolves(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_import_path_the_docs_name_still_works():
    paths = documented_paths()
    assert len(paths) > 20  # the scan found the docs' names
    broken = [f"{m}.{n}" if n else m for m, n in sorted(paths, key=str) if not resolves(f"{m}.{n}" if n else m)]
    assert broken == []


PINNED = {  # the public names the README and docs show
    "attnlab": ["GroupedQueryAttention", "MultiHeadAttention", "MultiHeadLatentAttention", "KVCache", "LatentCache",
                "RotaryEmbedding", "attend", "causal_mask"],
    "attnlab.convert": ["gqa_to_mla", "gqa_to_mha", "mla_to_mha", "absorb", "mha_to_gqa", "mha_to_mla", "convert",
                        "gqa_to_mla_decoupled", "selection_options", "probe_error", "ConversionReport"],
    "attnlab.hf": ["KVCache"],
    "attnlab.models": ["load_smollm2", "load_model", "save_model", "to_attnlab", "convert_model", "perplexity",
                       "kv_bytes_per_token", "load_checkpoint", "export_deepseek", "export_gguf", "convert_checkpoint"],
    "attnlab.heal": ["HealPlan", "Healer", "heal_model", "distill_loss", "warmup_steps", "normalised_mse"],
    "attnlab.io": ["save_module", "load_module", "write_folder"],
    "attnlab.bench": ["machine_info", "median_time", "run_benchmarks"],
    "attnlab.kernels": ["absorbed_decode", "absorbed_decode_reference"],
    "attnlab.cli": ["main", "app"],
}


@pytest.mark.parametrize("module", sorted(PINNED))
def test_pinned_public_names(module):
    import importlib

    m = importlib.import_module(module)
    assert [n for n in PINNED[module] if not hasattr(m, n)] == []


def test_console_script_and_python_m_run():
    proc = subprocess.run([sys.executable, "-m", "attnlab", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "tour" in proc.stdout and "heal" in proc.stdout
    scripts = json.loads(subprocess.run([sys.executable, "-c", "import json, importlib.metadata as m; print(json.dumps("
                                         "[e.value for e in m.entry_points(group='console_scripts', name='attnlab')]))"],
                                        capture_output=True, text=True, timeout=60).stdout)
    assert scripts == ["attnlab.cli:main"]
