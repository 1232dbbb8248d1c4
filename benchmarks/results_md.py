"""Writing one section of benchmarks/RESULTS.md, leaving every other section as it is."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"


def write_section(text: str, section: str, path: Path = RESULTS) -> None:
    """Replace the section headed `section` with `text` (or append it), keeping the others."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    text = text.rstrip("\n") + "\n"
    start = old.find(section)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(section))
        new = old[:start] + text + ("\n" + old[end + 1 :] if end >= 0 else "")
    path.write_text(new.rstrip("\n") + "\n")
