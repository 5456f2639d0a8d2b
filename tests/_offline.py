"""What makes a built page reach another host, read from its source; and widgets in notebooks.

Shared by tests/test_book.py (every built page, no browser needed) and tests/test_browser.py
(beside what Chromium itself requested).

* :func:`foreign_resources`: the URLs on another host that an HTML page loads by itself: scripts,
  stylesheets and other ``<link>`` resources (preload, preconnect, icons, ...), images
  (``srcset`` included), frames, media, ``<object>``, CSS ``url()`` and ``@import`` in ``<style>``
  and ``style=``, and the CDN that an embedded ipywidgets manager is told to load from
  (``data-jupyter-widgets-cdn``). Plain links (``<a href>``: GitHub, Colab's launch button) are
  followed only by a click: not requests.
* :func:`widget_problems`: the ipywidgets widgets a notebook holds (outputs of type
  ``application/vnd.jupyter.widget-view+json``, widget state in its metadata ``widgets``). From
  those myst-nb builds a page that loads ``require.js`` and ``@jupyter-widgets/html-manager`` from
  CDNs (its ``nb_ipywidgets_js``), and the widget, a tqdm.auto progress bar say, is drawn only online.
"""

from __future__ import annotations

import html.parser
import re
from urllib.parse import urlsplit

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"

# element -> attributes whose URL the browser fetches when it reads the page
_RESOURCE_ATTRS = {
    "script": ("src",),
    "img": ("src", "srcset"),
    "source": ("src", "srcset"),
    "iframe": ("src",),
    "frame": ("src",),
    "embed": ("src",),
    "object": ("data",),
    "video": ("src", "poster"),
    "audio": ("src",),
    "track": ("src",),
    "input": ("src",),
    "image": ("href", "xlink:href"),  # SVG
    "use": ("href", "xlink:href"),
    "link": ("href", "imagesrcset"),
}
# <link rel=...> that only name another page (nothing is fetched)
_NAVIGATION_RELS = {"canonical", "next", "prev", "previous", "index", "search", "author", "license", "alternate",
                    "help", "me", "bookmark", "home", "up", "first", "last", "contents", "copyright", "glossary"}
_CSS_URL = re.compile(r"""url\(\s*['"]?([^'")\s]+)|@import\s+['"]([^'"]+)""", re.IGNORECASE)


def is_foreign(url: str) -> bool:
    """An absolute URL (``https://host/...`` or ``//host/...``) on a host other than localhost."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme in ("data", "blob", "about", "javascript", "mailto"):
        return False
    if not parts.netloc:
        return False  # relative: the site itself
    return (parts.hostname or "") not in LOCAL_HOSTS


def _srcset_urls(value: str) -> list[str]:
    return [item.split()[0] for item in value.split(",") if item.strip()]


class _Scanner(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.urls: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k.lower(): (v or "") for k, v in attrs}
        wanted = _RESOURCE_ATTRS.get(tag, ())
        if tag == "link" and set(a.get("rel", "").lower().split()) <= _NAVIGATION_RELS and a.get("rel"):
            wanted = ()
        for name in wanted:
            if name in a:
                self.urls += _srcset_urls(a[name]) if name.endswith("srcset") else [a[name]]
        if "data-jupyter-widgets-cdn" in a:
            self.urls.append(a["data-jupyter-widgets-cdn"])
        if "style" in a:
            self._css(a["style"])
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self._css(data)

    def _css(self, text: str) -> None:
        self.urls += [m.group(1) or m.group(2) for m in _CSS_URL.finditer(text)]


def foreign_resources(page: str) -> list[str]:
    """The URLs on another host that the HTML ``page`` loads when a browser opens it, sorted."""
    scanner = _Scanner()
    scanner.feed(page)
    scanner.close()
    return sorted({u.strip() for u in scanner.urls if is_foreign(u)})


def widget_problems(nb: dict) -> list[str]:
    """What makes a notebook an ipywidgets page: each widget output (cell number and its text form)
    and widget state in the notebook's metadata. Empty when it holds none."""
    problems = []
    state = nb.get("metadata", {}).get("widgets")
    if state:
        n = len(state.get(WIDGET_STATE, {}).get("state", {})) if isinstance(state, dict) else 0
        problems.append(f"the notebook's metadata holds ipywidgets state ('widgets': {n} widget models)")
    code_cells = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    for i, cell in enumerate(code_cells):
        for out in cell.get("outputs", []):
            if WIDGET_VIEW in out.get("data", {}):
                text = "".join(out["data"].get("text/plain", ""))[:80]
                problems.append(f"code cell {i} (id {cell.get('id')!r}) displays an ipywidgets widget: {text!r}")
    return problems
