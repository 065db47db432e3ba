"""A shrink run's state on disk, what --resume continues from: the run folder beside the output (OUT.shrink-run)
with state.json (the request's identity, the phases done, minutes per phase, the plan, the heal plan, the report so
far), data.safetensors (the token windows), student/ (the converted model), heal.pt (the heal's checkpoint) and
healed/ (the healed model), each written atomically when its phase ends (shrink/pipeline.py runs the phases)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

RUN_FORMAT = "attnlab-shrink-run"


def run_folder(out) -> Path:
    """The run folder of an output path: OUT.shrink-run beside it."""
    out = Path(out)
    return out.with_name(out.name + ".shrink-run")


RUN_FILES = {"state.json", "data.safetensors", "student", "heal.pt", "healed"}  # what a run folder may hold


def is_run_folder(folder: Path) -> bool:
    """Whether a folder is a shrink's run folder: a state.json of RUN_FORMAT, and nothing beside what a run writes
    (RUN_FILES, and the temporaries of an atomic write a kill left): what --force may remove."""
    from ..io.folders import _TMP

    try:
        data = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError):
        return False
    names = {p.name for p in folder.iterdir()}
    return isinstance(data, dict) and data.get("format") == RUN_FORMAT and \
        all(n in RUN_FILES or _TMP in n for n in names)


class RunState:
    """The run folder: state.json, data.safetensors, student/ (a converted model), heal.pt. request: the run's
    ShrinkRequest (its identity() is what a resumed run must share)."""

    def __init__(self, folder: Path, request):
        self.folder, self.request = folder, request
        self.data: dict = {"format": RUN_FORMAT, "request": request.identity(), "done": [], "minutes": {},
                           "plan": None, "heal_plan": None, "report": {}}

    @property
    def path(self) -> Path:
        return self.folder / "state.json"

    def load(self) -> None:
        from ..io.readers import read_json

        if not self.path.is_file():
            raise ValueError(f"no shrink run to resume at {self.folder} (nothing to resume)")
        data = read_json(self.path)
        if data.get("format") != RUN_FORMAT:
            raise ValueError(f"{self.path} is not the state of an attnlab shrink run")
        theirs, mine = data.get("request", {}), self.request.identity()
        differ = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
        if differ:
            raise ValueError(f"--resume: this run's arguments differ from the run in {self.folder} "
                             f"({', '.join(f'{k}: {theirs.get(k)!r} -> {mine.get(k)!r}' for k in differ)}); "
                             "resume with the same ones, or start afresh with --force")
        self.data = data

    def save(self) -> None:
        from ..io.folders import replace_file

        self.folder.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, json.dumps(self.data, indent=2).encode())

    def done(self, phase: str) -> bool:
        return phase in self.data["done"]

    def finish(self, phase: str, minutes: float) -> None:
        if phase not in self.data["done"]:
            self.data["done"].append(phase)
        self.data["minutes"][phase] = self.data["minutes"].get(phase, 0.0) + minutes
        self.save()

    def save_data(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        from ..io.folders import replace_with

        self.folder.mkdir(parents=True, exist_ok=True)
        replace_with(self.folder / "data.safetensors",
                     lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp)))

    def load_data(self) -> dict[str, torch.Tensor]:
        from ..io.readers import read_tensors

        return read_tensors(self.folder / "data.safetensors")
