"""Browser checks of the Keyset page inside the Airflow UI, shared by the UI tests.

The page is a React app the Airflow UI renders in its own layout (``react_apps``), so every check
runs in the top document: there is no frame. ``READY`` is true once the page rendered its data (or
its error) at least once.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

READY = "(a => a && a.dataset.ready === '1')(document.querySelector('#keyset-app'))"


def open_in_airflow(
    browser: Any, base_url: str, route: str, token: str, ready: str = READY
) -> None:
    """Sign the browser in with Airflow's ``_token`` cookie and open the UI route ``route``
    (``plugin/keyset?...``, ``dags/D/runs/R/plugin/keyset-run``), waiting for ``ready``."""
    browser.open(f"{base_url}/keyset/icon.svg", "true")
    browser.set_cookie("_token", token)
    browser.open(f"{base_url}/{route}", ready, timeout=60)


def colour_mode(browser: Any, scheme: str) -> None:
    """Emulate ``prefers-color-scheme: scheme`` (CDP) and wait for Airflow's own colour mode to
    follow it: its theme is "system" by default and sets the class ``light`` or ``dark`` on
    ``<html>``, which Chakra's tokens (and so the page's colours) follow."""
    browser.driver.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"media": "", "features": [{"name": "prefers-color-scheme", "value": scheme}]},
    )
    browser.wait(f"document.documentElement.classList.contains('{scheme}')")


# Geometry of the page in the Airflow UI: sideways scrolling of the document, each table against
# its own scroll container, one-line clipped texts, and every element that scrolls vertically.
LAYOUT_JS = """(() => {
  const root = document.scrollingElement, app = document.querySelector('#keyset-app');
  const view = root.clientWidth;
  const vscrollers = [...document.querySelectorAll('*')].filter(e => {
    const s = getComputedStyle(e);
    return ['auto', 'scroll'].includes(s.overflowY) && e.scrollHeight > e.clientHeight + 1;
  }).map(e => ({name: e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') + '.' + [...e.classList].slice(0, 2).join('.'),
                 holdsPage: e !== app && e.contains(app)}));
  if (root.scrollHeight > root.clientHeight + 1) vscrollers.push({name: 'document', holdsPage: true});
  const box = e => e.getBoundingClientRect();
  return {
    view, pageScroll: root.scrollWidth, iframes: document.querySelectorAll('iframe').length,
    appRight: box(app).right, vscrollers,
    tables: [...app.querySelectorAll('.keyset-scroll')].map(c => ({
      scroll: c.scrollWidth, client: c.clientWidth, right: box(c).right,
      overflowX: getComputedStyle(c).overflowX, cls: c.firstElementChild.className})),
    clips: [...app.querySelectorAll('.keyset-clip')].map(e => ({text: e.textContent,
      title: e.title, lines: e.getClientRects().length, height: box(e).height,
      lineHeight: parseFloat(getComputedStyle(e).lineHeight) || 20,
      cut: e.scrollWidth > e.clientWidth})),
    // Chart labels drawn outside their SVG's viewBox are cut off (an SVG clips what overflows).
    chartCuts: [...app.querySelectorAll('svg.range-chart')].flatMap(svg => {
      const vb = svg.viewBox.baseVal;
      return [...svg.querySelectorAll('text')].map(t => ({text: t.textContent, b: t.getBBox()}))
        .filter(({b}) => b.x < vb.x - 0.5 || b.y < vb.y - 0.5 || b.x + b.width > vb.x + vb.width + 0.5
                        || b.y + b.height > vb.y + vb.height + 0.5)
        .map(({text, b}) => ({text, x: b.x, right: b.x + b.width, y: b.y, bottom: b.y + b.height,
                              viewBox: [vb.width, vb.height]}));
    }),
  };
})()"""


def assert_layout(layout: dict[str, Any], where: str) -> None:
    """No frame; the document never scrolls sideways and the page ends inside the view; each
        table fits its own scroll container; clipped texts are one line and carry the whole text as
        their title; exactly one element scrolls vertically, one that holds the page (Airflow's content
    area or the document): no double scrollbar, and no scrollbar of the page's own."""
    assert layout["iframes"] == 0, f"{where}: the page is in a frame"
    view = layout["view"]
    assert layout["pageScroll"] <= view, f"{where}: the page scrolls sideways ({layout})"
    assert layout["appRight"] <= view + 0.5, f"{where}: the page ends outside the view"
    assert layout["tables"], f"{where}: no table"
    for t in layout["tables"]:
        assert t["scroll"] <= t["client"], f"{where}: table clipped or scrolling {t}"
        assert t["right"] <= view + 0.5, f"{where}: table outside the view {t}"
    for c in layout["clips"]:
        assert c["lines"] == 1 and c["height"] < 1.6 * c["lineHeight"], f"{where}: wraps {c}"
        assert c["title"] == c["text"], f"{where}: no tooltip with the whole text {c}"
    assert layout.get("chartCuts", []) == [], f"{where}: chart labels cut off {layout['chartCuts']}"
    # One vertical scroller, and it is Airflow's (it holds the page), not one of the page's own.
    scrollers = layout["vscrollers"]
    assert len(scrollers) == 1 and scrollers[0]["holdsPage"], (
        f"{where}: vertical scrollers {scrollers}"
    )


COLOURS_JS = """(() => {
  const app = document.querySelector('#keyset-app');
  // Computed colours may be oklch(...) (Chakra's palette): a canvas pixel gives their sRGB.
  const ctx = Object.assign(document.createElement('canvas'), {width: 1, height: 1}).getContext('2d');
  const rgb = c => { ctx.clearRect(0, 0, 1, 1); ctx.fillStyle = c; ctx.fillRect(0, 0, 1, 1);
                     return [...ctx.getImageData(0, 0, 1, 1).data]; };
  let el = app, bg = [0, 0, 0, 0];
  while (el && bg[3] === 0) { bg = rgb(getComputedStyle(el).backgroundColor); el = el.parentElement; }
  const cell = app.querySelector('table.ranges td');
  return {text: rgb(getComputedStyle(app).color), cell: rgb(getComputedStyle(cell).color), bg: bg.slice(0, 3),
          mode: document.documentElement.className};
})()"""


def luminance(rgb: list[float]) -> float:
    """WCAG relative luminance of an sRGB colour (0 black .. 1 white)."""

    def lin(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(float(c)) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: list[float], b: list[float]) -> float:
    """WCAG contrast ratio of two colours (1 .. 21)."""
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def mean_brightness(png: Path) -> float:
    """Mean of a screenshot's greyscale pixels (0 .. 255)."""
    with Image.open(png) as img:
        grey = img.convert("L")
        hist = grey.histogram()
        return sum(i * n for i, n in enumerate(hist)) / (grey.width * grey.height)


def colours(png: Path) -> tuple[tuple[int, int], Counter[tuple[int, int, int]]]:
    """``(size, pixel count per RGB colour)`` of a screenshot."""
    with Image.open(png) as img:
        rgb = img.convert("RGB")
        pairs = rgb.getcolors(maxcolors=rgb.width * rgb.height) or []
        return rgb.size, Counter({colour: n for n, colour in pairs})


def keep_screenshots(*pngs: Path) -> None:
    """Copy screenshots to ``$KEYSET_UI_SCREENSHOT_DIR`` when it is set (CI keeps them)."""
    target = os.environ.get("KEYSET_UI_SCREENSHOT_DIR")
    if target:
        for png in pngs:
            shutil.copy(png, Path(target) / png.name)


def severe(entries: list[dict[str, Any]]) -> list[str]:
    return [e["message"] for e in entries if e.get("level") == "SEVERE"]
