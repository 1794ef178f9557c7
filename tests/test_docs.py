"""The docs point at what exists: every relative link in the repository's Markdown resolves to a file or folder in
the repository, and no link or path leaves it (a reader of a clone has nothing else)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    skip = {".venv", ".venvs", "outputs", ".git", "node_modules"}
    return [p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts)]


def broken_links(md: Path) -> list[str]:
    """Links of ``md`` that do not resolve inside the repository (web links and in-page anchors aside)."""
    bad = []
    for target in LINK.findall(md.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (md.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT):
            bad.append(f"{md.relative_to(ROOT)}: {target} leaves the repository")
        elif not path.exists():
            bad.append(f"{md.relative_to(ROOT)}: {target} does not exist")
    return bad


def test_every_relative_link_resolves_inside_the_repository() -> None:
    files = markdown_files()
    assert any(p.name == "README.md" and p.parent == ROOT for p in files)
    bad = [b for md in files for b in broken_links(md)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_dead_link_and_one_that_leaves(tmp_path: Path) -> None:
    md = ROOT / "docs" / "_probe_links.md"
    md.write_text("[ok](../README.md) [dead](../nope.json) [out](../../shared/x.md) [web](https://x.org) [a](#b)")
    try:
        bad = broken_links(md)
    finally:
        md.unlink()
    assert bad == ["docs/_probe_links.md: ../nope.json does not exist",
                   "docs/_probe_links.md: ../../shared/x.md leaves the repository"], bad
