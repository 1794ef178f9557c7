"""The smoke run's pages as a reader sees them: Debian's chromium opens each one from disk with DNS blocked.

Asserts that every plotly figure drew its SVG, that no page fetched anything but local files or threw a
script error, that no page carries progress-bar or log noise or a stray ``Out[]`` value, that index.html's
links resolve, and that plotly.js exists once in the run folder. Screenshots are kept under
``outputs/browser-test/<run>/`` (gitignored) for a person to look at.

Shares the session's smoke run (``smoke_run`` in conftest.py) with the end-to-end test. Where chromium or
playwright is missing the test is skipped, except under CI (``CI=true``), where scripts/test.sh installs
both, so a missing install fails instead of hiding.
"""

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from eagle3lab import report

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND"]

# What must not reach a page: tqdm refreshes and its widget warning; vLLM's log format ("INFO 11-29 20:53:11
# [file.py:88] ..."); papermill's cell markers; Python logging's default format.
NOISE = re.compile(
    r"\d+%\|[^|\n]*\|\s*\d+/\d+|\d+(\.\d+)?it/s\]|IProgress not found|"
    r"^(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[|Executing Cell \d+|^(INFO|WARNING):[\w.]+:",
    re.M,
)


def _need(what: str, ok: bool) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{what} is missing: scripts/test.sh installs it")
        pytest.skip(f"{what} is not installed")


@pytest.fixture(scope="module")
def browser():
    _need("chromium", Path(CHROMIUM).exists())
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("playwright (python)", False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def _visit(browser, path: Path, shot: Path) -> dict:
    """Open one page from disk; return what it drew and fetched."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    remote, errors = [], []
    page.on("request", lambda r: remote.append(r.url) if not r.url.startswith(("file:", "data:", "blob:", "about:")) else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.resolve().as_uri(), wait_until="load")
    figures = page.locator(".plotly-graph-div").count()
    # a figure is drawn when plotly made its SVG and put a trace in it (a heatmap draws an image)
    is_drawn = "d => d.querySelector('svg.main-svg') && d.querySelector('svg.main-svg .trace, svg.main-svg .hm image')"
    if figures:  # plotly draws asynchronously; a figure that never draws is reported below, by count
        with contextlib.suppress(PlaywrightTimeout):
            page.wait_for_function(f"() => [...document.querySelectorAll('.plotly-graph-div')].every({is_drawn})",
                                   timeout=20_000)
    drawn = page.evaluate(f"() => [...document.querySelectorAll('.plotly-graph-div')].filter({is_drawn}).length")
    text = page.inner_text("body")
    prompts = page.eval_on_selector_all(".jp-OutputPrompt", "els => els.map(e => e.textContent.trim())")
    links = page.eval_on_selector_all("a[href]", "els => els.map(e => e.getAttribute('href'))")
    page.screenshot(path=str(shot), full_page=True)
    page.close()
    return {"figures": figures, "drawn": drawn, "remote": remote, "errors": errors, "text": text,
            "out_prompts": [p for p in prompts if p.startswith("Out")], "links": links}


@pytest.mark.slow
def test_every_page_opens_offline_and_draws(smoke_run, browser):
    run_dir = smoke_run.run_dir
    pages = sorted(run_dir.glob("*.html"))
    steps = json.loads((run_dir / "metrics.json").read_text())["steps"]
    assert [p.name for p in pages] == sorted(["index.html"] + [s["html"] for s in steps if s["html"]])
    shots = ROOT / "outputs" / "browser-test" / run_dir.name
    shots.mkdir(parents=True, exist_ok=True)

    seen = {p.name: _visit(browser, p, shots / f"{p.stem}.png") for p in pages}
    for name, v in seen.items():
        assert v["remote"] == [], (name, v["remote"])
        assert v["errors"] == [], (name, v["errors"])
        assert v["drawn"] == v["figures"], f"{name}: {v['figures'] - v['drawn']} figure(s) drew no SVG"
        noise = NOISE.findall(v["text"]) and [m.group(0) for m in NOISE.finditer(v["text"])][:3]
        assert not noise, (name, noise)
        assert v["out_prompts"] == [], f"{name}: stray Out[] values {v['out_prompts']}"
    assert sum(v["figures"] for v in seen.values()) >= 5, {n: v["figures"] for n, v in seen.items()}
    assert seen["index.html"]["figures"] == 1

    for href in seen["index.html"]["links"]:
        target = urlparse(href)
        assert not target.scheme and not target.netloc, f"index.html links off the run folder: {href}"
        assert (run_dir / unquote(target.path)).is_file(), f"index.html: broken link {href}"

    # page weight: plotly.js once, next to the pages, loaded by a relative script tag
    assert (run_dir / report.PLOTLY_JS).is_file()
    for p in pages:
        html = p.read_text()
        assert not report.inline_plotly_js(html) and report.external_scripts(html) == [], p.name
        assert p.stat().st_size < 1_500_000, f"{p.name}: {p.stat().st_size} bytes"


@pytest.mark.slow
def test_run_record_is_readable(smoke_run):
    """run.log: one line per step and per real warning; notebooks: no Out[] values (display explicitly) and no
    progress bar in the record (every module's bars go through eagle3lab.progress, silent in batch runs)."""
    import nbformat

    run_dir = smoke_run.run_dir
    lines = (run_dir / "run.log").read_text().splitlines()
    steps = json.loads((run_dir / "metrics.json").read_text())["steps"]
    assert len(lines) <= 3 + 2 * len(steps) + 10, "\n".join(lines)
    for s in steps:
        said = f" {s['name']}: skipped" if s["status"] == "skipped" else f" {s['name']}: {s['status']} in "
        assert sum(said in ln for ln in lines) == 1, (s["name"], lines)
    assert not any(NOISE.search(ln) for ln in lines), [ln for ln in lines if NOISE.search(ln)]
    for s in steps:
        if s["ipynb"]:
            nb = nbformat.read(str(run_dir / s["ipynb"]), as_version=4)
            outs = [(c.execution_count, o) for c in nb.cells for o in c.get("outputs", [])]
            stray = [n for n, o in outs if o.output_type == "execute_result"]
            assert stray == [], f"{s['ipynb']}: cells {stray} end in a bare expression (Out[] on the page)"
            bars = [n for n, o in outs if report.WIDGET_MIME in o.get("data", {})
                    or (o.output_type == "stream" and NOISE.search(o.text))]
            assert bars == [], f"{s['ipynb']}: cells {bars} carry a progress bar (use eagle3lab.progress)"
