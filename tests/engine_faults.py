"""Faults injected into the engine process, which a test's monkeypatch does not reach: the code is written as a
`sitecustomize` module on the child's PYTHONPATH, so it runs when the engine process's interpreter starts (and in
every other Python the test starts while the variable is set)."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path


def inject_into_engine(monkeypatch, folder: Path, code: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent(code))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
