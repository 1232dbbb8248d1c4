"""The fenced code blocks of the user docs (README.md, docs/**/*.md) that the docs runner executes.

A block runs when its info string names a shell (bash, sh, shell, zsh) or Python (python, py,
python3); other languages (json, yaml, text, console, none) are shown, never run. The line
`<!-- norun: REASON -->` as the last non-blank line before a fence keeps that block from running;
the reason is required. Fences may be indented (inside list items) and use ``` or ~~~.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

SHELLS = ("bash", "sh", "shell", "zsh")
PYTHONS = ("python", "py", "python3")
NORUN = re.compile(r"^\s*<!--\s*norun\s*(?::(?P<reason>.*?))?\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its code, and why it must not run (if so)."""

    path: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    code: str
    norun: str | None = None
    """The reason given with `<!-- norun: ... -->`; "" when the marker has no reason."""

    @property
    def kind(self) -> str | None:
        """"bash" or "python" for blocks the runner executes, else None."""
        if self.lang in SHELLS:
            return "bash"
        if self.lang in PYTHONS:
            return "python"
        return None

    def test_id(self, root: Path) -> str:
        """`docs/service.md:13`: the file, relative to the repository, and the fence's line."""
        try:
            rel = self.path.relative_to(root)
        except ValueError:
            rel = self.path
        return f"{rel.as_posix()}:{self.line}"


def info_language(info: str) -> str:
    """The language of a fence's info string (`python title="x.py"`, `{.bash}`: python, bash)."""
    info = info.strip()
    if not info:
        return ""
    word = info.split()[0].strip("{}")
    return word.lstrip(".").lower()


def parse_blocks(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of the Markdown file `path`, in order."""
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, indent = m.group("fence"), m.group("indent")
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence[0] * len(fence)) and not close.lstrip(fence[0]).strip():
                break
            body.append(lines[i])
            i += 1
        i += 1  # past the closing fence (or the end of an unclosed block)
        code = textwrap.dedent("\n".join(_strip_indent(b, indent) for b in body))
        blocks.append(Block(path, start + 1, info_language(m.group("info")), code + "\n",
                            _norun(lines, start)))
    return blocks


def _strip_indent(line: str, indent: str) -> str:
    return line[len(indent):] if indent and line.startswith(indent) else line


def _norun(lines: list[str], fence: int) -> str | None:
    j = fence - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0:
        return None
    m = NORUN.match(lines[j])
    if m is None:
        return None
    return (m.group("reason") or "").strip()


def doc_files(root: Path) -> list[Path]:
    """README.md and every Markdown page under docs/ (new pages are picked up as they appear)."""
    files = [root / "README.md"] if (root / "README.md").is_file() else []
    files += sorted(p for p in (root / "docs").rglob("*.md") if p.is_file())
    return files


def runnable_blocks(root: Path) -> list[Block]:
    """The blocks of the user docs that the runner executes or reports as not run."""
    return [b for path in doc_files(root) for b in parse_blocks(path) if b.kind is not None]
