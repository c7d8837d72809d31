"""Checks of the paths kvflow writes to (results directories, reports, plots), made before
any work: each returns why a path cannot be written (a sentence), or None."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def output_dir_problem(path: Path, *, create: bool = False) -> Optional[str]:
    """Why `path` cannot be (or become) a directory kvflow writes into. With `create`, it is
    made and a probe file written and removed, so that write permission is tested for real."""
    path = Path(path)
    for p in [path, *path.parents]:
        if p.exists():
            if not p.is_dir():
                return f"{p} is a file, not a directory"
            break
    if not create:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".kvflow-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"cannot write there: {e.strerror or e}"
    return None


def output_file_problem(path: Path) -> Optional[str]:
    """Why a file cannot be written at `path` (a directory there, no such folder, no access)."""
    path = Path(path)
    if path.is_dir():
        return "is a directory"
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return f"no such directory: {folder}"
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "not writable"
    return None
