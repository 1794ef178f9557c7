"""benchmarks/tools/slim_pages.py: the head's stylesheet moves to one shared file; nothing else in the page changes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "tools"))

import slim_pages  # noqa: E402


def _page(big: str) -> str:
    return (f'<html><head><meta charset="utf-8">\n<style type="text/css">{big}</style>\n<script src="x.js"></script>\n'
            '<style type="text/css">.b{color:red}</style>\n</head><body><style>#T_1 th {text-align: left;}</style>'
            "<p>hi</p></body></html>")


def test_head_styles_move_to_one_shared_file_and_the_rest_stays(tmp_path: Path) -> None:
    shared, run = tmp_path / "gpu", tmp_path / "gpu" / "session" / "workbook"
    run.mkdir(parents=True)
    big = ".a{margin:0}" * 20_000
    for name in ("a.html", "b.html"):
        (run / name).write_text(_page(big))
    saved = [slim_pages.slim_page(p, shared) for p in sorted(run.glob("*.html"))]
    assert saved[0] > len(big) - 200 and saved[0] == saved[1]
    css = list(shared.glob("nbconvert-*.css"))
    assert len(css) == 1 and css[0].read_text() == big + "\n" + ".b{color:red}"  # both head blocks, in order
    page = (run / "a.html").read_text()
    assert f'href="../../{css[0].name}"' in page
    assert '<script src="x.js"></script>' in page and "#T_1 th" in page and "<p>hi</p>" in page  # untouched
    assert page.index("<link") < page.index("</head>")
    # a second run changes nothing
    assert slim_pages.slim_page(run / "a.html", shared) == 0 and (run / "a.html").read_text() == page


def test_a_page_without_the_template_styles_is_left_alone(tmp_path: Path) -> None:
    page = tmp_path / "p.html"
    page.write_text(_page(".a{margin:0}"))
    before = page.read_text()
    assert slim_pages.slim_page(page, tmp_path) == 0 and page.read_text() == before
    assert not list(tmp_path.glob("*.css"))
