"""Store the nbconvert stylesheet of committed report pages once, under ``benchmarks/gpu/``, as plotly.js already is.

Every page that nbconvert's lab template writes inlines the same 262 KB of CSS in its ``<head>``; a run's six pages
carry it six times. This moves the ``<head>``'s style blocks of each page into one file named by its content
(``benchmarks/gpu/nbconvert-<sha256[:12]>.css``) and links it from the page, so pages render as before (the same
rules, in the same order, at the same place in the head) while the evidence folder stays small. Style blocks in the
body (pandas tables' own) stay inline. Pages without the large head styles are left as they are; running it twice
changes nothing.

    python benchmarks/tools/slim_pages.py benchmarks/gpu/<session>/workbook [more folders ...]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1] / "gpu"
STYLE = re.compile(r"<style[^>]*>(.*?)</style>\s*", re.S)
MIN_CSS = 100_000  # nbconvert's template styles; a page below this was slimmed already or is not nbconvert's


def slim_page(page: Path, shared: Path = SHARED) -> int:
    """Bytes saved in ``page`` (0 when it had no large head styles); writes the shared CSS file once."""
    text = page.read_text(encoding="utf-8")
    end = text.find("</head>")
    if end < 0:
        return 0
    blocks = list(STYLE.finditer(text, 0, end))
    css = "\n".join(m.group(1) for m in blocks)
    if len(css) < MIN_CSS:
        return 0
    name = f"nbconvert-{hashlib.sha256(css.encode()).hexdigest()[:12]}.css"
    target = shared / name
    if not target.exists():
        target.write_text(css, encoding="utf-8")
    href = Path(os.path.relpath(target, page.parent)).as_posix()
    link = f'<link rel="stylesheet" type="text/css" href="{href}">\n'
    out = text[: blocks[0].start()] + link
    prev = blocks[0].end()
    for m in blocks[1:]:
        out += text[prev : m.start()]  # what lay between the blocks (meta tags, scripts) stays in place
        prev = m.end()
    out += text[prev:]
    page.write_text(out, encoding="utf-8")
    return len(text.encode()) - len(out.encode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    args = ap.parse_args()
    for folder in args.folders:
        for page in sorted(folder.rglob("*.html")):
            saved = slim_page(page)
            print(f"{page}: {saved:,} bytes saved" if saved else f"{page}: unchanged")


if __name__ == "__main__":
    main()
