"""The built site in headless Chromium: the state diagram renders to SVG and no page logs an error.

Needs Debian's `chromium` and `chromium-driver` (/usr/bin/chromium, /usr/bin/chromedriver) and the
`selenium` package; skipped with the reason when any is missing. The site is served on 127.0.0.1 and
loads nothing from elsewhere (Mermaid is vendored, Google Fonts are off).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("SPECCYCLE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("SPECCYCLE_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,2000",  # tall enough for the whole state diagram in one screenshot
)


def _chromium_missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(path) or shutil.which(path)):
            return f"{path} not found: apt-get install -y chromium chromium-driver"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install -e '.[docs]'"
    return None


pytestmark = pytest.mark.skipif(_chromium_missing() is not None, reason=str(_chromium_missing()))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def base_url(site_dir: Path):
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _svg_count(driver) -> int:
    """SVG elements in the page, shadow roots included (Material renders Mermaid into a closed one)."""
    document = driver.execute_cdp_cmd("DOM.getDocument", {"depth": -1, "pierce": True})
    count, stack = 0, [document["root"]]
    while stack:
        node = stack.pop()
        count += node.get("nodeName", "").lower() == "svg" and _in_mermaid(node)
        stack.extend(node.get("children", []))
        stack.extend(node.get("shadowRoots", []))
    return count


def _in_mermaid(node: dict) -> bool:
    # Mermaid's SVG carries the id Material gives it (`__mermaid_<n>`) and aria-roledescription.
    attrs = node.get("attributes", [])
    pairs = dict(zip(attrs[::2], attrs[1::2]))
    return pairs.get("id", "").startswith("__mermaid_") or "aria-roledescription" in pairs


def _wait_for_diagrams(driver, expected: int, timeout: float = 20.0) -> int:
    deadline, count = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        count = _svg_count(driver)
        if count >= expected:
            return count
        time.sleep(0.2)
    return count


def _severe(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_the_state_diagram_renders_to_svg(browser, base_url, tmp_path):
    browser.get(f"{base_url}/cycle/")
    assert _wait_for_diagrams(browser, 1) >= 1, "the state diagram did not render to an <svg>"
    assert not browser.find_elements("css selector", "pre.mermaid"), "a mermaid block was left unrendered"
    host = browser.find_element("css selector", "div.mermaid")
    assert host.size["height"] > 200, f"the diagram is only {host.size['height']} px high"
    browser.execute_script("document.querySelector('header.md-header').style.visibility = 'hidden'")  # not on top
    shot = Path(os.environ.get("SPECCYCLE_DOCS_SCREENSHOT", tmp_path / "cycle.png"))
    host.screenshot(str(shot))
    assert shot.stat().st_size > 5000
    assert _severe(browser) == []


def test_the_worked_example_tree_renders(browser, base_url):
    browser.get(f"{base_url}/transitions/verify/")
    assert _wait_for_diagrams(browser, 1) >= 1, "the tree of the worked example did not render"
    assert _severe(browser) == []


def test_no_page_logs_an_error(browser, base_url, site_dir: Path):
    pages = sorted(p.parent.relative_to(site_dir).as_posix() for p in site_dir.glob("**/index.html"))
    assert len(pages) >= 15
    errors = {}
    for page in pages:
        browser.get(f"{base_url}/{'' if page == '.' else page + '/'}")
        browser.execute_script("return document.readyState")
        if browser.find_elements("css selector", "pre.mermaid, div.mermaid"):
            _wait_for_diagrams(browser, 1, timeout=10)
        severe = _severe(browser)
        if severe:
            errors[page] = severe
    assert errors == {}
