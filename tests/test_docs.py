"""The code's references to the design documents resolve inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["README.md", "ds4_mlx", "custom_kernels", "convert", "tests", "benchmarks", "docs"]
SUFFIXES = {".py", ".md", ".body", ".h", ".metal", ".cu", ".cuh"}
REFERENCE = re.compile(r"docs/(model|quants|serving)\.md §(\d+(?:\.\d+)?)")
OUTSIDE = re.compile(r"(?<![/\w.])(MODEL|QUANTS|SERVING)\.md")  # the reference engine's notes, not shipped


def _texts():
    for name in SOURCES:
        path = ROOT / name
        for f in [path] if path.is_file() else sorted(path.rglob("*")):
            if f.suffix in SUFFIXES and f.is_file() and ".venv" not in f.parts:
                yield f, f.read_text(encoding="utf-8", errors="replace")


def _sections(doc: str) -> set[str]:
    heads = re.findall(r"^#+ (\d+(?:\.\d+)?)[ .]", (ROOT / "docs" / f"{doc}.md").read_text(encoding="utf-8"), re.M)
    return set(heads)


def test_section_references_resolve():
    sections = {doc: _sections(doc) for doc in ("model", "quants", "serving")}
    missing = [f"{f.relative_to(ROOT)}: docs/{doc}.md §{sec}" for f, text in _texts()
               for doc, sec in REFERENCE.findall(text) if sec not in sections[doc]]  # fmt: skip
    assert not missing, missing
    assert sum(len(REFERENCE.findall(text)) for _, text in _texts()) > 100  # the pattern still finds them


def test_no_references_to_documents_outside_the_repository():
    found = [f"{f.relative_to(ROOT)}" for f, text in _texts() if OUTSIDE.search(text)]
    assert not found, found
