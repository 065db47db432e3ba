"""No file of the repository shadows an installed package: a script run from its folder puts that folder first on
sys.path, so benchmarks/kernels.py once hid the `kernels` package transformers imports."""
import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folders whose files run as scripts or sit on sys.path: benchmarks/ and each of its folders of scripts
SCRIPT_FOLDERS = ("benchmarks", *sorted(str(p.parent.relative_to(ROOT)) for p in ROOT.glob("benchmarks/*/*.py")),
                  "scripts", "tests")


def _installed_names() -> set[str]:
    """Top-level import names of every installed distribution and of the standard library."""
    names = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    return {n for n in names if n and not n.startswith("_")}


def _module_names(folder: Path) -> dict[str, Path]:
    """What `import NAME` would find in folder: its .py files, its packages and its other folders (namespace
    packages: benchmarks/quality/ is `quality` to a script that puts benchmarks/ on sys.path)."""
    found = {p.stem: p for p in folder.glob("*.py")}
    found.update({p.name: p for p in folder.iterdir() if p.is_dir()})
    return found


def test_no_repository_module_shadows_an_installed_package():
    assert {"benchmarks/quality", "benchmarks/engines", "benchmarks/speed"} <= set(SCRIPT_FOLDERS)
    installed = _installed_names()
    assert {"torch", "json", "transformers"} & installed  # the look-up itself found something to compare with
    clashes = [f"{path.relative_to(ROOT)} shadows {name!r}"
               for folder in SCRIPT_FOLDERS for name, path in _module_names(ROOT / folder).items()
               if name in installed and name != "conftest"]
    assert clashes == []
