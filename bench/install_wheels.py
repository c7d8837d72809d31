"""Install every distribution in a folder of wheels into a target directory, offline, for the
interpreter that runs this (stdlib only: it runs before pydantic & co. exist).

    python bench/install_wheels.py WHEEL_DIR TARGET    # then put TARGET first on PYTHONPATH

With pip: `pip install --no-index --find-links WHEEL_DIR --target TARGET <every name there>`
(pip picks the wheel of this interpreter's tags and checks that the folder holds every
dependency). Without pip: each distribution's best wheel for this interpreter (CPython
version, manylinux x86_64 / any) is unzipped onto TARGET (wheels are zip files; `.data/purelib`
and `.data/platlib` go to the root). Used by bench/gpu_check.sh (wheels from bench/gpu_wheels.sh).
"""

from __future__ import annotations

import importlib.util
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _score(py: str, abi: str, plat: str) -> int:
    """How well a wheel's tags fit this interpreter: 0 = not at all, higher = more specific."""
    cp = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    pys, abis, plats = py.split("."), abi.split("."), plat.split(".")
    if "any" not in plats:
        machine = platform.machine().lower()
        if sys.platform != "linux" or not any(p.endswith(machine) and "linux" in p for p in plats):
            return 0
    if cp in pys and (cp in abis or "abi3" in abis or "none" in abis):
        return 3
    stable = [int(p[3:]) for p in pys if re.fullmatch(r"cp3\d+", p)]
    if stable and "abi3" in abis and min(stable) <= sys.version_info[1]:
        return 2
    if "py3" in pys and "none" in abis:
        return 1
    return 0


def best_wheels(wheel_dir: Path) -> dict[str, Path]:
    """Distribution name -> the wheel in `wheel_dir` that fits this interpreter best."""
    best: dict[str, tuple[int, Path]] = {}
    for path in sorted(wheel_dir.glob("*.whl")):
        m = _WHEEL.match(path.name)
        if not m:
            continue
        score = _score(m["py"], m["abi"], m["plat"])
        name = _norm(m["name"])
        if score and score > best.get(name, (0, path))[0]:
            best[name] = (score, path)
    return {name: path for name, (_, path) in best.items()}


def unzip_wheel(path: Path, target: Path) -> None:
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            name = info.filename
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts, headers, data: not needed to import
                name = "/".join(parts[2:])
            if not name or name.endswith("/"):
                continue
            dest = target / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    wheel_dir, target = Path(argv[0]), Path(argv[1])
    wheels = best_wheels(wheel_dir)
    if not wheels:
        print(f"install_wheels: no wheel in {wheel_dir} fits Python {platform.python_version()} "
              f"({sys.platform} {platform.machine()})", file=sys.stderr)
        return 1
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    if importlib.util.find_spec("pip") is not None:
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-warn-conflicts", "--no-index",
               "--find-links", str(wheel_dir), "--target", str(target), *sorted(wheels)]
        print("install_wheels:", " ".join(cmd), file=sys.stderr)
        return subprocess.call(cmd)
    print(f"install_wheels: no pip here; unzipping {len(wheels)} wheels onto {target}", file=sys.stderr)
    for name, path in sorted(wheels.items()):
        unzip_wheel(path, target)
        print(f"  {path.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
