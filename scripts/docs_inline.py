"""Code the docs show from repository files is inline, so the pages read the same where the
repository is browsed (a host renders no include directive: a `--8<--` block showed empty).

A block that shows a file, or a section of one (`# --8<-- [start:name]` ... `[end:name]` in
the file, those marker lines left out, dedented), is written out in full after a marker
comment:

    <!-- docs-inline: plugins/kvflow-example-ngram/tests/test_ngram_pruner.py:contract -->
    ```python
    # plugins/kvflow-example-ngram/tests/test_ngram_pruner.py
    ...the section's lines...
    ```

The first line names the file (a `#` comment: every file shown this way is Python, YAML or
TOML). `python scripts/docs_inline.py` rewrites README.md and docs/ from the files (a
`--8<-- "path[:section]"` line alone in a fenced block is turned into such a block), and
`--check` exits 1 naming every block that differs from its file (tests/test_docs_inline.py).
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- docs-inline: (?P<ref>\S+) -->$")
SNIPPET = re.compile(r'^--8<-- "(?P<ref>[^"]+)"$')
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def split_ref(ref: str) -> tuple[str, str | None]:
    path, _, section = ref.partition(":")
    return path, section or None


def source(ref: str) -> list[str]:
    """The lines a block showing `ref` holds after its header line: the file, or its section."""
    path, section = split_ref(ref)
    lines = (REPO / path).read_text(encoding="utf-8").splitlines()
    if section is None:
        return lines
    start = [i for i, x in enumerate(lines) if f"--8<-- [start:{section}]" in x]
    end = [i for i, x in enumerate(lines) if f"--8<-- [end:{section}]" in x]
    if len(start) != 1 or len(end) != 1 or end[0] < start[0]:
        raise ValueError(f"{path}: no single section '{section}' (# --8<-- [start:{section}] ... [end:{section}])")
    kept = [x for x in lines[start[0] + 1 : end[0]] if "--8<-- [start:" not in x and "--8<-- [end:" not in x]
    return textwrap.dedent("\n".join(kept)).splitlines()  # a method shows from column 0


def block(ref: str, lang: str) -> list[str]:
    return [f"<!-- docs-inline: {ref} -->", f"```{lang}", f"# {split_ref(ref)[0]}", *source(ref), "```"]


def render(text: str) -> str:
    """`text` with every snippet block inlined and every inline block refreshed from its file."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if m and i + 1 < len(lines) and FENCE.match(lines[i + 1]):
            lang = FENCE.match(lines[i + 1])["lang"]
            j = i + 2
            while j < len(lines) and lines[j] != "```":
                j += 1
            out += block(m["ref"], lang)
            i = j + 1
            continue
        f = FENCE.match(lines[i])
        if f and i + 2 < len(lines) and SNIPPET.match(lines[i + 1]) and lines[i + 2] == "```":
            out += block(SNIPPET.match(lines[i + 1])["ref"], f["lang"])
            i += 3
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def stale() -> list[str]:
    """Pages whose inline blocks differ from their files, or that still hold a snippet block."""
    out = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        if render(text) != text:
            out.append(str(page.relative_to(REPO)))
    return out


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        bad = stale()
        for page in bad:
            print(f"{page}: an include directive, or an inline block that differs from the file it shows; "
                  "run python scripts/docs_inline.py")
        return 1 if bad else 0
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            print(f"updated {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
