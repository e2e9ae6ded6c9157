"""`planc explain --html`: one self-contained page, checked as written and in a real browser.

The page for plans/seed.plan on the tiny seed transformer at world 4 (input 2x16) must hold
every unit (tree and table), the memory plot as inline SVG, and no external address, script
or stylesheet link. Then headless Chromium (Debian's `chromium` package) loads it from disk:
its DOM has the units and the `<svg>`, and its screenshot really shows them (the units'
colours are on screen, the page is not blank). Skipped, with the reason, only when no
chromium is installed. `UPDATE_SCREENSHOT=1` also saves the screenshot as
docs/img/explain-report.png (the README's picture).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

pytest.importorskip("matplotlib")

from planc import cli  # noqa: E402
from planc.analysis.report_html import PALETTE  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
UNITS = ["embedding", "transformer_layers.0", "transformer_layers.1", "[norm, output]", "&lt;root&gt;"]
ARGS = ["explain", "plans/seed.plan", "--model", "planc.zoo:seed_transformer_tiny",
        "--world-size", "4", "--input-shape", "2x16"]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    path = tmp_path_factory.mktemp("html") / "report.html"
    here = os.getcwd()
    os.chdir(ROOT)  # the page names the plan as given: `plans/seed.plan`
    try:
        assert cli.main([*ARGS, "--html", str(path)]) == 0
    finally:
        os.chdir(here)
    return path


def test_page_has_units_table_and_plot(page):
    html = page.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    for name in UNITS:
        assert f"unit {name}<" in html, name          # a badge in the tree
        assert f"<code>{name}</code>" in html, name   # a row of the table
    assert html.count("<svg") == 1 and "memory per rank over one step" in html
    # each unit has its own colour, used in both the tree and the table
    for colour in PALETTE[:len(UNITS)]:
        assert html.count(f"background:{colour}") >= 3, colour


def test_page_is_self_contained(page):
    html = page.read_text(encoding="utf-8")
    assert not re.search(r"<(script|link|img|iframe|object)\b", html, re.I)
    assert not re.search(r"\b(src|href)\s*=\s*['\"]?(https?:|//)", html, re.I)
    assert "@import" not in html and "url(" not in html.replace("url(#", "")
    # what is left of the web in it: the SVG namespace names, identifiers nothing fetches
    assert set(re.findall(r"https?://[^\s\"'<>)]+", html)) <= {"http://www.w3.org/2000/svg",
                                                                "http://www.w3.org/1999/xlink"}


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    return found


def browse(page: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1400,1500", *flags, page.as_uri()],
                          capture_output=True, text=True, timeout=120, cwd=page.parent)


def test_browser_renders_units_and_plot(page):
    dom = browse(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    for name in UNITS:
        assert f"unit {name}<" in dom.stdout, name
    assert "<svg" in dom.stdout and "memory per rank over one step" in dom.stdout

    shot = page.parent / "shot.png"
    run = browse(page, f"--screenshot={shot}")
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    import matplotlib.image
    pixels = matplotlib.image.imread(shot)[..., :3]  # floats in [0, 1]
    assert pixels.shape[:2] == (1500, 1400)
    assert (pixels.min(axis=2) < 0.9).mean() > 0.05   # ink: text, table rules, the plot
    rgb = {tuple(round(c * 255) for c in px) for px in pixels.reshape(-1, 3)[::7]}
    for colour in PALETTE[:len(UNITS)]:             # the units' colours are on screen
        want = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
        assert any(max(abs(a - b) for a, b in zip(want, got)) <= 2 for got in rgb), colour
    if os.environ.get("UPDATE_SCREENSHOT"):
        (ROOT / "docs" / "img").mkdir(exist_ok=True)
        shutil.copyfile(shot, ROOT / "docs" / "img" / "explain-report.png")
