"""The built book as a reader sees it: every page in headless Chromium, at a desktop and a phone width.

The book is built once per session (tests/_book_build.py, shared with tests/test_book.py), served
from a thread on a free localhost port, and opened in headless Chromium driven by Selenium through
the Debian chromedriver (an explicit path: Selenium Manager never downloads a driver). Every page,
at 1280x900 and at 390x844 (a phone), must have:

* no JavaScript error in the console (no SEVERE log entry),
* its formulas typeset by MathJax (no raw ``$$``, ``\\(`` or ``\\[`` left in the text),
* every image loaded (``naturalWidth > 0``),
* not one request to any host but the local server, seen three ways: every request Chromium
  made (its performance log: the DevTools protocol's ``Network.requestWillBeSent`` and
  ``Network.webSocketCreated``), every entry of the page's resource timing
  (``performance.getEntriesByType("resource")``), and every resource the page's HTML names
  (tests/_offline.py: scripts, stylesheets, preloads, images, frames, CSS ``url()``, an ipywidgets
  manager's CDN); ``test_outside_requests_are_caught`` checks the three on a synthetic page shaped
  like a chapter that displays a tqdm.auto progress bar (an ipywidgets widget: myst-nb then loads
  ``require.js`` and the widget manager from CDNs), so that the check cannot quietly stop working,
* at the phone width, nothing wider than the screen, except inside a box that scrolls sideways
  (code, formulas), and those boxes really scroll.

Also: the table-of-contents button opens the sidebar on the phone (and hides and shows it on the
desktop), the page-contents button opens the page's sections on the phone, and the search page
finds a page. A screenshot of every page at every width is saved
under the test's temporary folder and copied to ``_build/screenshots/`` (the path is printed).

Needs ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` (Debian: ``apt-get install chromium
chromium-driver``; ``make setup`` installs them when it can); skipped, saying so, without them.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from _book_build import REPO, BookBuild, build_book_once
from _offline import foreign_resources

CHROMIUM = Path(os.environ.get("GPTLAB_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("GPTLAB_CHROMEDRIVER", "/usr/bin/chromedriver"))
CHROME_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync")
WIDTHS = {"desktop": (1280, 900, False), "phone": (390, 844, True)}
SCREENSHOTS_COPY = REPO / "_build" / "screenshots"
MAX_SCREENSHOT_HEIGHT = 8000

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()),
        reason=(f"BROWSER TEST SKIPPED: headless Chromium is not installed ({CHROMIUM} and {CHROMEDRIVER} are needed). "
                "Install the Debian packages: sudo apt-get install chromium chromium-driver (or run `make setup` as root), "
                "or point GPTLAB_CHROMIUM / GPTLAB_CHROMEDRIVER at a Chromium and its matching chromedriver."),
    ),
]


# ---------------------------------------------------------------------------------------------
# fixtures: the build, a local web server, a browser


@pytest.fixture(scope="session")
def book(tmp_path_factory: pytest.TempPathFactory) -> BookBuild:
    return build_book_once(tmp_path_factory)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass


@contextlib.contextmanager
def _serve(directory: Path) -> Iterator[str]:
    """``http://127.0.0.1:<free port>``, serving ``directory`` from a thread."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, name="book-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def site(book: BookBuild) -> Iterator[str]:
    """The built ``_build/html``, served on localhost."""
    book.check()
    with _serve(book.html) as url:
        yield url


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in CHROME_ARGS:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    d = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    d.set_page_load_timeout(60)
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("screenshots")
    yield folder
    if any(folder.iterdir()):
        shutil.rmtree(SCREENSHOTS_COPY, ignore_errors=True)
        shutil.copytree(folder, SCREENSHOTS_COPY)
        print(f"\nscreenshots of the book: {folder} (copied to {SCREENSHOTS_COPY})")


def _pages(book: BookBuild) -> list[str]:
    return sorted(p.relative_to(book.html).as_posix() for p in book.html.rglob("*.html")
                  if not p.relative_to(book.html).parts[0].startswith("_"))


# ---------------------------------------------------------------------------------------------
# helpers


def _set_viewport(d: webdriver.Chrome, width: int, height: int, mobile: bool) -> None:
    d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                      {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})


def _open(d: webdriver.Chrome, url: str) -> None:
    """Load ``url`` and wait until its scripts, images and MathJax are done."""
    d.get(url)
    WebDriverWait(d, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
    d.set_script_timeout(30)
    d.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const images = Array.from(document.images).map(img => {
          img.loading = "eager";
          return img.complete ? Promise.resolve() : new Promise(r => { img.onload = img.onerror = r; });
        });
        const math = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
        Promise.all([...images, math, document.fonts.ready]).then(() => done(true), () => done(false));
    """)


def _drain_logs(d: webdriver.Chrome) -> tuple[list[dict], list[str]]:
    """Console entries and requested URLs (DevTools' network events) since the last call."""
    console = d.get_log("browser")
    urls = []
    for entry in d.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
        elif message["method"] == "Network.webSocketCreated":
            urls.append(message["params"]["url"])
    return console, urls


def _foreign(urls: list[str], site: str) -> list[str]:
    host = urlsplit(site).netloc
    return sorted({u for u in urls if urlsplit(u).scheme not in ("data", "blob", "about")
                   and urlsplit(u).netloc != host})


# every resource the current page fetched (failed fetches included), and the page itself
_RESOURCE_TIMING = """
    return performance.getEntriesByType("navigation").concat(performance.getEntriesByType("resource"))
                      .map(e => e.name);
"""


def _outside_requests(d: webdriver.Chrome, site: str, urls: list[str], source: str) -> list[str]:
    """Every way the page just opened reaches a host other than ``site``: the requests in
    Chromium's DevTools log (``urls``, from :func:`_drain_logs`), the page's resource timing
    entries, and the resources its HTML ``source`` names (:func:`_offline.foreign_resources`)."""
    found = [f"request to another host (DevTools network log): {u}" for u in _foreign(urls, site)]
    found += [f"request to another host (resource timing): {u}" for u in _foreign(d.execute_script(_RESOURCE_TIMING), site)]
    found += [f"loads a resource from another host (page source): {u}" for u in foreign_resources(source)]
    return found


def _screenshot(d: webdriver.Chrome, path: Path) -> None:
    """The whole page (up to MAX_SCREENSHOT_HEIGHT pixels), not only the part on screen."""
    width, height = d.execute_script(
        "return [document.documentElement.clientWidth, document.documentElement.scrollHeight]")
    shot = d.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": width, "height": min(height, MAX_SCREENSHOT_HEIGHT), "scale": 1},
    })
    path.write_bytes(base64.b64decode(shot["data"]))


_MATH_TEXT = """
    const article = document.querySelector("article") || document.body;
    const copy = article.cloneNode(true);
    copy.querySelectorAll("pre, code, script, style, mjx-container, mjx-assistive-mml, .highlight").forEach(e => e.remove());
    return [document.querySelectorAll("mjx-container").length,
            document.querySelectorAll(".math, span.math, div.math").length,
            copy.textContent];
"""

_BROKEN_IMAGES = """
    return Array.from(document.images).filter(img => !(img.complete && img.naturalWidth > 0))
                .map(img => img.currentSrc || img.src);
"""

# Elements that stick out of the screen sideways, unless a box around them (inside the screen)
# scrolls sideways; and the scrolling boxes that overflow, with whether they actually scroll.
_OVERFLOW = """
    const W = document.documentElement.clientWidth;
    const scrolls = el => ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
    const onScreen = el => { const r = el.getBoundingClientRect(); return r.left >= -1 && r.right <= W + 1; };
    const bad = [];
    for (const el of document.body.querySelectorAll("*")) {
      const r = el.getBoundingClientRect();
      if (r.width === 0 || r.height === 0 || (r.right <= W + 1 && r.left >= -1)) continue;
      const style = getComputedStyle(el);
      if (style.visibility === "hidden" || style.position === "fixed") continue;
      // clipped out of sight on purpose, for screen readers (e.g. MathJax's mjx-assistive-mml)
      let hidden = false;
      for (let a = el; a && a !== document.body; a = a.parentElement) {
        const s = getComputedStyle(a);
        if ((s.position === "absolute" && s.clip !== "auto") || s.clipPath !== "none") { hidden = true; break; }
      }
      if (hidden) continue;
      let box = el.parentElement, contained = false;
      while (box && box !== document.body) {
        if (scrolls(box) && onScreen(box)) { contained = true; break; }
        box = box.parentElement;
      }
      if (!contained) bad.push(`${el.tagName.toLowerCase()}.${el.className} [${Math.round(r.left)}, ${Math.round(r.right)}]`);
    }
    const stuck = [];
    for (const el of document.body.querySelectorAll("*")) {
      if (!scrolls(el) || el.scrollWidth <= el.clientWidth + 1 || el.clientWidth === 0) continue;
      el.scrollLeft = 100000;
      if (el.scrollLeft === 0) stuck.push(`${el.tagName.toLowerCase()}.${el.className}`);
      el.scrollLeft = 0;
    }
    return [document.documentElement.scrollWidth, W, bad.slice(0, 20), stuck];
"""


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("width", list(WIDTHS))
def test_every_page_renders_offline(book: BookBuild, site: str, driver: webdriver.Chrome, screenshots: Path, width: str):
    w, h, mobile = WIDTHS[width]
    _set_viewport(driver, w, h, mobile)
    pages = _pages(book)
    assert {"book/intro.html", "search.html"} <= set(pages), pages
    problems: list[str] = []
    _drain_logs(driver)
    for page in pages:
        if driver.current_url.startswith(site):
            driver.execute_script("window.localStorage.clear()")  # every page as on a first visit
        _open(driver, f"{site}/{page}")
        _screenshot(driver, screenshots / f"{width}-{page.replace('/', '-').removesuffix('.html')}.png")
        console, urls = _drain_logs(driver)
        for entry in console:
            if entry["level"] == "SEVERE":
                problems.append(f"{page}: console error: {entry['message']}")
        problems += [f"{page}: {p}" for p in _outside_requests(driver, site, urls, (book.html / page).read_text())]
        typeset, math_nodes, text = driver.execute_script(_MATH_TEXT)
        if math_nodes and not typeset:
            problems.append(f"{page}: {math_nodes} formulas but nothing typeset by MathJax")
        for raw in ("$$", "\\(", "\\)", "\\[", "\\]", "\\begin{"):
            if raw in text:
                at = text.index(raw)
                problems.append(f"{page}: raw TeX {raw!r} in the text: ...{text[max(0, at - 60):at + 60]!r}...")
        for src in driver.execute_script(_BROKEN_IMAGES):
            problems.append(f"{page}: image not loaded: {src}")
        if width == "phone":
            scroll_width, screen, bad, stuck = driver.execute_script(_OVERFLOW)
            if scroll_width > screen:
                problems.append(f"{page}: the page is {scroll_width}px wide on a {screen}px screen")
            problems += [f"{page}: sticks out of the screen, not in a scrolling box: {b}" for b in bad]
            problems += [f"{page}: overflowing box does not scroll: {s}" for s in stuck]
    assert not problems, "\n".join(problems)
    # the pages with formulas were really checked
    _open(driver, f"{site}/book/intro.html")
    assert driver.execute_script("return document.querySelectorAll('mjx-container').length") > 0


# What myst-nb writes into the page of a notebook whose cell displayed an ipywidgets widget (a
# tqdm.auto progress bar): the widget's view and state, and its nb_ipywidgets_js scripts.
_WIDGET_OUTPUT = """
<div class="cell_output docutils container"><div class="output text_html">
<script type="application/vnd.jupyter.widget-view+json">{"model_id": "7f3c", "version_major": 2, "version_minor": 0}</script>
</div></div>
<script type="application/vnd.jupyter.widget-state+json">{"state": {}, "version_major": 2, "version_minor": 0}</script>
"""


def _synthetic_page(head: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>synthetic</title>{head}</head>"
            f"<body><article><h1>A page</h1><p>text</p>{body}</article></body></html>")


def test_outside_requests_are_caught(driver: webdriver.Chrome, tmp_path: Path):
    """The offline checks of test_every_page_renders_offline, on synthetic pages served from localhost.

    A page shaped like a chapter whose training cell displayed a tqdm.auto bar as a widget (the
    scripts come from myst-nb's own default ``nb_ipywidgets_js``, plus a stylesheet and an image
    on other hosts): each of the three ways (DevTools network log, resource timing, page source)
    must report each outside URL. A page with only local resources: nothing reported.
    """
    from myst_nb.core.config import ipywidgets_js_factory

    widget_js = ipywidgets_js_factory()
    assert widget_js, "myst-nb no longer loads any script for widgets: update this test"
    scripts = "".join(f'<script src="{src}" ' + " ".join(f'{k}="{v}"' for k, v in attrs.items()) + "></script>"
                      for src, attrs in widget_js.items())
    outside = ['<link rel="stylesheet" href="https://example.org/theme.css">', '<img src="//example.net/pixel.png" alt="">']
    (tmp_path / "widget.html").write_text(_synthetic_page(scripts + outside[0], _WIDGET_OUTPUT + outside[1]))
    (tmp_path / "local.js").write_text("window.localScript = true;\n")
    (tmp_path / "local.css").write_text("p { color: #222; }\n")
    (tmp_path / "clean.html").write_text(_synthetic_page(
        '<link rel="stylesheet" href="local.css"><script src="local.js"></script>'
        '<link rel="next" href="https://example.com/elsewhere.html">',  # names a page: no request
        '<a href="https://example.com/">a link (followed only on a click)</a>'))
    with _serve(tmp_path) as local:
        _drain_logs(driver)
        _open(driver, f"{local}/clean.html")
        _, urls = _drain_logs(driver)
        assert driver.execute_script("return window.localScript === true"), "the local page did not load"
        assert _outside_requests(driver, local, urls, (tmp_path / "clean.html").read_text()) == []

        _open(driver, f"{local}/widget.html")
        _, urls = _drain_logs(driver)
        found = _outside_requests(driver, local, urls, (tmp_path / "widget.html").read_text())
    expected = [*widget_js, "https://example.org/theme.css", "//example.net/pixel.png"]
    for way in ("DevTools network log", "resource timing", "page source"):
        reported = [f for f in found if f"({way})" in f]
        for url in expected:
            # the browser reports the protocol-relative URL with the page's scheme
            assert any(f.endswith(url.removeprefix("//")) for f in reported), \
                f"{url} was not reported by the {way} check; it reported:\n" + "\n".join(reported)
    assert any("cdn.jsdelivr.net/npm/" in f and f.endswith("/npm/") for f in found), \
        "the widget manager's CDN (data-jupyter-widgets-cdn) was not reported"


def test_toc_button_opens_the_sidebar_on_a_phone(site: str, driver: webdriver.Chrome, screenshots: Path):
    _set_viewport(driver, *WIDTHS["phone"])
    _open(driver, f"{site}/book/intro.html")
    _drain_logs(driver)
    nav_links = driver.find_elements(By.CSS_SELECTOR, ".bd-docs-nav a")
    assert nav_links, "the page has no table of contents"
    assert not any(a.is_displayed() for a in nav_links), "on a phone the table of contents starts hidden"
    toggles = [b for b in driver.find_elements(By.CSS_SELECTOR, ".primary-toggle") if b.is_displayed()]
    assert len(toggles) == 1, f"expected one visible table-of-contents button, found {len(toggles)}"
    toggles[0].click()  # a real click, as a finger would
    try:
        WebDriverWait(driver, 5).until(lambda d: any(a.is_displayed() for a in d.find_elements(By.CSS_SELECTOR, ".bd-docs-nav a")))
    except TimeoutException:
        pytest.fail("the table-of-contents button does not open the sidebar on a phone")
    visible = [a for a in driver.find_elements(By.CSS_SELECTOR, ".bd-docs-nav a") if a.is_displayed()]
    rect = visible[0].rect
    assert 0 <= rect["x"] < WIDTHS["phone"][0] and 0 <= rect["y"] < WIDTHS["phone"][1], rect
    driver.save_screenshot(str(screenshots / "phone-toc-open.png"))  # the screen, with the sidebar over the page
    # a link in the opened sidebar leads to its page
    target = next(a for a in visible if a.get_attribute("href").endswith("setup_check.html"))
    target.click()
    WebDriverWait(driver, 10).until(lambda d: d.current_url.endswith("setup_check.html"))
    console, _ = _drain_logs(driver)
    assert not [e for e in console if e["level"] == "SEVERE"], console


def test_contents_button_opens_the_page_contents_on_a_phone(site: str, driver: webdriver.Chrome):
    """The other sidebar button: this page's sections (the secondary sidebar) open on a phone."""
    _set_viewport(driver, *WIDTHS["phone"])
    _open(driver, f"{site}/book/intro.html")
    links = lambda: driver.find_elements(By.CSS_SELECTOR, "#pst-page-toc-nav a")  # noqa: E731
    assert links() and not any(a.is_displayed() for a in links()), "on a phone the page contents start hidden"
    toggles = [b for b in driver.find_elements(By.CSS_SELECTOR, ".secondary-toggle") if b.is_displayed()]
    assert len(toggles) == 1, f"expected one visible page-contents button, found {len(toggles)}"
    toggles[0].click()
    try:
        WebDriverWait(driver, 5).until(lambda d: any(a.is_displayed() for a in links()))
    except TimeoutException:
        pytest.fail("the page-contents button does not open this page's sections on a phone")


def test_toc_button_hides_and_shows_the_sidebar_on_a_desktop(site: str, driver: webdriver.Chrome):
    _set_viewport(driver, *WIDTHS["desktop"])
    _open(driver, f"{site}/book/intro.html")
    sidebar = driver.find_element(By.ID, "pst-primary-sidebar")
    assert sidebar.is_displayed()
    toggle = next(b for b in driver.find_elements(By.CSS_SELECTOR, ".primary-toggle") if b.is_displayed())
    toggle.click()
    WebDriverWait(driver, 5).until(lambda d: not d.find_element(By.ID, "pst-primary-sidebar").is_displayed())
    toggle.click()
    WebDriverWait(driver, 5).until(lambda d: d.find_element(By.ID, "pst-primary-sidebar").is_displayed())


def test_search_finds_a_page(site: str, driver: webdriver.Chrome, screenshots: Path):
    _set_viewport(driver, *WIDTHS["desktop"])
    _open(driver, f"{site}/search.html?q=tokenizer")
    # Sphinx shows its results one at a time (a timer between each), and writes
    # the summary line only after the last one: wait for that line, not the first result.
    try:
        WebDriverWait(driver, 30).until(
            lambda d: d.find_element(By.CSS_SELECTOR, "#search-results p.search-summary").get_attribute("textContent").strip())
    except TimeoutException:
        pytest.fail("the search page did not finish for 'tokenizer': " + driver.find_element(By.ID, "search-results").text)
    summary = driver.find_element(By.CSS_SELECTOR, "#search-results p.search-summary").get_attribute("textContent")
    hrefs = [a.get_attribute("href") for a in driver.find_elements(By.CSS_SELECTOR, "#search-results ul.search li a")]
    assert hrefs, "the search page found nothing for 'tokenizer': " + summary
    assert any("book/intro.html" in h or "book/setup_check.html" in h for h in hrefs), hrefs
    _screenshot(driver, screenshots / "desktop-search-results.png")
