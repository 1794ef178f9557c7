"""The profile picker and the acceptance explorer driven through JupyterLab's own page, as a reader uses them.

Starts ``jupyter lab`` on a temporary folder (fresh workspace and settings: no autosave, no news; the
folder is the workbook root, with two profiles), opens a notebook that calls ``open_workbook`` without
injected parameters and then ``eagle3lab.explorer.explore`` over a synthetic run, runs it, and in headless
chromium picks another profile, another prompt and another aux-layer set in the widgets' menus: the
choice must be remembered, and the token view and the figure must follow. Any JupyterLab dialog fails the
test. Screenshots go to ``outputs/browser-test/lab/``.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from explorer_data import write_run
from test_browser import ARGS, CHROMIUM, _need

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "eagle3lab-test"
SETTINGS = {  # user settings: nothing may change files or open a dialog on its own
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    _need("jupyterlab", shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is not None)
    pytest.importorskip("ipywidgets")
    write_run(tmp_path / "runs" / "20260101-000000-synthetic")
    nb = nbformat.v4.new_notebook()
    (tmp_path / "params").mkdir()
    for name in ("embedded", "smoke"):  # two small profiles to pick from
        shutil.copy(ROOT / "tests" / "smoke.yaml", tmp_path / "params" / f"{name}.yaml")
    nb.cells = [nbformat.v4.new_code_cell('from eagle3lab.workbook import open_workbook\nwb = open_workbook("lab")'),
                nbformat.v4.new_code_cell(f"from eagle3lab.explorer import explore\nex = explore({str(tmp_path / 'runs')!r})")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(tmp_path / "explore.ipynb"))
    settings = tmp_path / "settings"
    for rel, value in SETTINGS.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(value))
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "jupyter-lab"), "--no-browser", "--allow-root", f"--port={port}",
           "--ip=127.0.0.1", f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={tmp_path}",
           f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", f"--LabApp.user_settings_dir={settings}",
           "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None"]
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), EAGLE3LAB_ROOT=str(tmp_path))
    env.pop("EAGLE3LAB_PARAMS", None)
    with open(tmp_path / "lab.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        try:
            deadline = time.time() + 120
            while time.time() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert proc.poll() is None, (tmp_path / "lab.log").read_text()
                    time.sleep(0.5)
            yield tmp_path, f"http://127.0.0.1:{port}/lab/tree/explore.ipynb?reset&token={TOKEN}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.slow
def test_picker_and_explorer_follow_the_widgets_in_jupyterlab(lab):
    root, url = lab
    _need("chromium", Path(CHROMIUM).exists())
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("playwright (python)", False)
    shots = ROOT / "outputs" / "browser-test" / "lab"
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        # DNS stays blocked except for the local server (nothing may come from the network)
        args = [a for a in ARGS if not a.startswith("--host-resolver-rules")]
        args.append("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)

        def idle():
            page.wait_for_function("() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]"
                                   ".some(e => e.textContent.includes('| Idle'))", timeout=120_000)

        def no_dialog():
            assert page.locator(".jp-Dialog").count() == 0, page.locator(".jp-Dialog").first.text_content()

        def output_text():  # textContent: Lab lays out only what is on screen
            return page.locator(".jp-Cell-outputArea").nth(1).text_content()

        explorer_has = ("text => (document.querySelectorAll('.jp-Cell-outputArea')[1] || {textContent: ''})"
                        ".textContent.includes(text)")

        idle()
        no_dialog()
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_function(explorer_has, arg="prompt 0: tau = 2.75", timeout=120_000)
        idle()
        page.wait_for_selector(".jp-Cell-outputArea .js-plotly-plot svg.main-svg", timeout=60_000)
        no_dialog()
        page.screenshot(path=str(shots / "explorer-first.png"), full_page=True)

        # the profile picker: it shows the profile that ran, and remembers another for the next run
        picker = page.locator(".jp-Cell-outputArea").nth(0)
        assert "running embedded" in picker.text_content()
        picker.locator(".widget-dropdown select").select_option(label="smoke")
        page.wait_for_function("() => document.querySelector('.jp-Cell-outputArea').textContent"
                               ".includes('next run: smoke')", timeout=30_000)
        assert (root / "outputs" / ".lab-profile").read_text().strip() == str(root / "params" / "smoke.yaml")

        selects = page.locator(".jp-Cell-outputArea").nth(1).locator(".widget-dropdown select")
        assert selects.count() == 6  # run, aux layers, k, prompts, temperature, prompt
        selects.nth(5).select_option(index=2)  # prompt 2
        page.wait_for_function(explorer_has, arg="prompt 2: tau = 2.00", timeout=60_000)
        assert "prompt 0: tau" not in output_text()
        selects.nth(1).select_option(label="[2, 3, 4]")  # the ablation drafter: one prompt, fewer accepted
        page.wait_for_function(explorer_has, arg="prompt 0: tau = 1.25", timeout=60_000)
        text = output_text()
        assert "drafter [2, 3, 4], k = 3" in text  # the figure's title followed too
        page.wait_for_selector(".jp-Cell-outputArea .js-plotly-plot svg.main-svg", timeout=60_000)
        no_dialog()
        page.screenshot(path=str(shots / "explorer-after-picks.png"), full_page=True)
        browser.close()
