"""Old import paths, kept working: where each module of the flat layout lives now.

`import attnlab.gqa`, `from attnlab.decoupled import gqa_to_mla_decoupled`
give the module at its new home (the same object, not a copy), imported only when asked for:
an import hook installed by attnlab/__init__.py answers for the names in MOVED and for nothing else.
The dependency rule (tests/test_layers.py) does not apply here: these are names, not imports.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

MOVED = {
    "attnlab.attention": "attnlab.modules.attention",
    "attnlab.base": "attnlab.modules.base",
    "attnlab.cache": "attnlab.modules.cache",
    "attnlab.checks": "attnlab.modules.checks",
    "attnlab.gqa": "attnlab.modules.gqa",
    "attnlab.mla": "attnlab.modules.mla",
    "attnlab.rope": "attnlab.modules.rope",
    "attnlab.linalg": "attnlab.convert.linalg",
    "attnlab.decoupled": "attnlab.convert.decoupled",
    "attnlab.transforms": "attnlab.convert.transforms",
    "attnlab.report": "attnlab.convert.report",
    "attnlab.usaaio": "attnlab.study.usaaio",
    "attnlab.tour": "attnlab.study.tour",
    "attnlab.generate": "attnlab.generation",
    "attnlab.decoder": "attnlab.generation.generator",
    "attnlab.heal_data": "attnlab.heal.data",
    "attnlab.heal_encoder": "attnlab.heal.encoder",
    "attnlab.bench_model": "attnlab.bench.model",
    "attnlab.presets": "attnlab.bench.presets",
    "attnlab.plots": "attnlab.cli.plots",
    "attnlab.cli_base": "attnlab.cli.base",
    "attnlab.cli_export": "attnlab.cli.export",
    "attnlab.cli_heal": "attnlab.cli.heal",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and hands back the module at its new home."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        # the import system has just set module.__spec__ to the old name's spec; the module keeps its own
        module.__spec__ = importlib.machinery.PathFinder.find_spec(module.__name__, _parent_path(module.__name__))


def _parent_path(name: str):
    parent = name.rpartition(".")[0]
    return sys.modules[parent].__path__ if parent else None


def install() -> None:
    """Put the finder on sys.meta_path once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
