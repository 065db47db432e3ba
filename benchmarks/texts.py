"""The texts the protocol reads, by role (docs/evaluation.md, "Three kinds of text"), each with the SHA-256 of the file
its rows were measured on. A text is checked when it is read: a file that differs raises a ValueError naming it.

- REPORT_TEXTS: the four held-out texts every headline figure is scored on. Only the scoring reads them, after a run;
  no default, constant or threshold was chosen by looking at them.
- TRAINING_TEXTS: the user's own text of the protocol's `--text` cases (shrink trains, calibrates and judges its heal
  on it, holding out its last tenth). Each is near one report text in kind and shares none of its text.

- DEV_TEXTS: development texts, which a default is fitted on (`protocol.py --dev` scores a run on them instead of the
  report texts); none of the report or training texts.

Three files are Python's own (pydoc_data.topics, statistics.py, argparse.py): another Python's differ, and the check
says so; `protocol.py --texts-from DIR` reads copies of the report texts instead.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Text:
    path: str
    sha256: str  # of the file's bytes
    kind: str


def _module_file(name: str) -> str:
    import importlib

    return importlib.import_module(name).__file__


REPORT_TEXTS = {  # name: Text
    "python-docs": Text(_module_file("pydoc_data.topics"),
                        "abaa56a64551d8eead1b19cbae3c6db443f99f0cab81df07bed3cb75c0db9346", "Python reference prose"),
    "tech-docs": Text("/usr/share/doc/dpkg/spec/triggers.txt",
                      "ef31fe26ba143c85070cf52929d3d237d471afb5fac31c93dd886a2543a42d7b",
                      "technical documentation (Debian)"),
    "study": Text(str(REPO.parent / "shared" / "study" / "001_653f0055448b2b7d.txt"),
                  "ba18fa26bb65bd73dceee9afa931bf36f1486a26963abaaba4a51efcb97243e6", "a maths/ML study text"),
    "licence": Text("/usr/share/common-licenses/GFDL-1.3",
                    "110535522396708cea37c72a802c5e7e81391139f5f7985631c93ef242b206a4", "a licence (GFDL 1.3)"),
}
# Node.js's reference for its events module (reference documentation of another language), the GNU GPL 3 (a licence),
# Python's statistics module (source with docstrings on maths); none of the report texts' text nor the judge's
# (heal.data.judge_texts)
TRAINING_TEXTS = (
    Text("/usr/share/doc/nodejs/api/events.md", "ff2d3f7e5c961ca687a9ebf99f7e670d6fcc81bcbba352f8c4fc67ce851b73c9",
         "reference documentation (Node.js events)"),
    Text("/usr/share/common-licenses/GPL-3", "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986",
         "a licence (GPL 3)"),
    Text(_module_file("statistics"), "889a066f1b8063e73387ceb84018efc507a89b365b56c6afb9cc15b2ed25c2d9",
         "Python source with maths docstrings"),
)


DEV_TEXTS = {  # name: Text
    "mpl": Text("/usr/share/common-licenses/MPL-2.0",
                "fab3dd6bdab226f1c08630b1dd917e11fcb4ec5e1e020e2c16f83a0a13863e85", "a licence (MPL 2.0)"),
    "argparse": Text(_module_file("argparse"), "dc1eba8adfdf615986421f981337458ba1072d3e718a0f76e3224940fd74118b",
                     "Python source (argparse.py)"),
    "git-notes": Text("/usr/share/doc/git/RelNotes/2.27.0.txt",
                      "ad61705f84bf2908e48494fe056ff4bb451fc5f1e9fb0fae26f4ed73bc0e7c73", "release notes (git 2.27)"),
    "apache": Text("/usr/share/common-licenses/Apache-2.0",
                   "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30", "a licence (Apache 2.0)"),
}


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def checked(text: Text) -> str:
    """The text's path, once its file is the one the rows were measured on; ValueError naming the file otherwise."""
    if not Path(text.path).is_file():
        raise ValueError(f"{text.path}: no such file ({text.kind}; benchmarks/texts.py): the study text is read from "
                         "the shared/ folder beside the repository's own folder, the others from the OS and Python")
    found = sha256(text.path)
    if found != text.sha256:
        raise ValueError(f"{text.path}: sha256 {found}, expected {text.sha256}: not the text the rows were measured "
                         f"on ({text.kind}; benchmarks/texts.py)")
    return text.path
