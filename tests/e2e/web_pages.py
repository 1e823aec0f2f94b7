"""Helpers for the browser tests of the web pages (test_web_chat.py, test_web_dashboard.py):
Playwright driving Debian's chromium, headless. A test module imports what it uses; the
`browser` fixture (one chromium per session) lives in conftest.py and skips when chromium or
playwright is missing."""
from __future__ import annotations

import os
import shutil

import pytest

from kvserve_server import ROOT

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (make deps)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make deps)")
SHOTS = os.path.join(ROOT, "build", "screenshots")


def screenshot(page, name: str) -> str:
    os.makedirs(SHOTS, exist_ok=True)
    path = os.path.join(SHOTS, name)
    page.screenshot(path=path, full_page=True)
    return path


def set_key(page, key: str):
    """Types the API key as a user would (the pages keep it in localStorage)."""
    page.fill("#apikey", key)
    page.dispatch_event("#apikey", "change")


def ask(page, text: str, max_tokens: int, temperature: float = 0):
    page.fill("#temperature", str(temperature))
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#input", text)
    page.click("#send")


def last_stats(page, timeout_ms: int = 60_000):
    page.wait_for_function(
        "() => { const s = document.querySelectorAll('.assistant .stats'); return s.length && s[s.length - 1].textContent; }",
        timeout=timeout_ms)
    return page.locator(".assistant .stats").last
