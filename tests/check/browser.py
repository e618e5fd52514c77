"""Look at an HTML page the way a person does: headless Chromium (Debian's ``chromium``
package, which ``make test`` installs when it can) driven by Playwright, which launches
that executable rather than a browser of its own."""

from __future__ import annotations

import io
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str:
    """The browser to use; a missing one fails the test (it is a requirement, not an
    option: `make test` installs it as root, or set LLMCTL_CHROMIUM)."""
    found = os.environ.get("LLMCTL_CHROMIUM") or next(
        (path for path in map(shutil.which, NAMES) if path), None)
    if not found:
        pytest.fail("no Chromium to render report.html: `apt-get install chromium` (make test "
                    "does it when run as root) or set LLMCTL_CHROMIUM to a Chrome/Chromium")
    return found


@dataclass
class Rendered:
    screenshot: bytes
    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    image_widths: list[int] = field(default_factory=list)  # 0: an image that did not decode
    text: str = ""


def render(page_path: Path, width: int = 1200) -> Rendered:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: the suite may run as root, where Chromium's sandbox refuses to start
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            seen = Rendered(b"")
            page.on("console", lambda m: seen.console_errors.append(m.text)
                    if m.type == "error" else None)
            page.on("pageerror", lambda e: seen.console_errors.append(str(e)))
            page.on("request", lambda r: seen.requests.append(r.url))
            page.goto(Path(page_path).resolve().as_uri(), wait_until="load")
            seen.image_widths = page.evaluate("[...document.images].map(i => i.naturalWidth)")
            seen.text = page.inner_text("body")
            seen.screenshot = page.screenshot(full_page=True)
            return seen
        finally:
            browser.close()


def ink(png: bytes) -> float:
    """The fraction of the screenshot's pixels that are not the background's colour."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    return float((pixels != pixels[0, 0]).any(axis=-1).mean())
