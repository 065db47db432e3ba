"""Every docstring in the package is 1-5 lines (the project's style: the reasoning and figures live in
docs/decisions.md, details beside the code they describe), read from the source."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "attnlab"
MOST = 5


def long_docstrings(source: str, name: str) -> list[str]:
    """The module, class and function docstrings of `source` over MOST lines, as "name:line (n lines)"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None and len(doc.strip().splitlines()) > MOST:
                found.append(f"{name}:{getattr(node, 'lineno', 1)} ({len(doc.strip().splitlines())} lines)")
    return found


def test_every_docstring_is_at_most_five_lines():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50  # the package was read, not an empty folder
    found = [hit for path in files for hit in long_docstrings(path.read_text(), str(path.relative_to(SRC)))]
    assert not found, found


def test_the_check_catches_a_long_docstring():
    six = '"""' + "\n".join(["a line"] * 6) + '"""'
    assert long_docstrings(f"def f():\n    {six}\n", "x.py") == ["x.py:1 (6 lines)"]
    assert long_docstrings(f"{six}\n", "m.py") == ["m.py:1 (6 lines)"]
    assert long_docstrings('def f():\n    """one\n    two"""\n', "y.py") == []
