"""CORS: a web page from another origin calls the API (vLLM's --allowed-origins, default any).

The judge is the browser itself: chromium (through Playwright) sends the preflight a request with
an Authorization header needs, and lets the page read the answer only if the server's headers
allow its origin. The page is served by Python's http.server on another port: another origin.
"""
from __future__ import annotations

import functools
import http.server
import threading

import pytest
import requests

from kvserve_server import MODEL_NAME, Server, free_port
from web_pages import needs_chromium, sync_api  # noqa: F401  (skips without playwright)

PAGE = """<!doctype html><html><body><script>
async function ask(url, key) {
  const headers = {"Content-Type": "application/json"};
  if (key) headers["Authorization"] = "Bearer " + key;
  try {
    const r = await fetch(url + "/v1/chat/completions", {method: "POST", headers,
      body: JSON.stringify({model: "%s", messages: [{role: "user", content: "Hi"}], max_tokens: 4, stream: true})});
    const text = await r.text();
    return {status: r.status, text, retry: r.headers.get("Retry-After")};
  } catch (e) {
    return {error: String(e)};
  }
}
</script></body></html>""" % MODEL_NAME


@pytest.fixture(scope="module")
def other_origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    (root / "index.html").write_text(PAGE)
    port = free_port()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{port}"
    httpd.shutdown()


def ask_from(browser, origin: str, url: str, key: str | None):
    page = browser.new_page()
    try:
        page.goto(origin + "/index.html")
        return page.evaluate("([url, key]) => ask(url, key)", [url, key])
    finally:
        page.close()


@needs_chromium
def test_a_page_from_another_origin_streams_an_answer_by_default(server, browser, other_origin):
    r = ask_from(browser, other_origin, server.url, None)
    assert r.get("status") == 200 and "data: [DONE]" in r["text"], r


@needs_chromium
def test_an_allowed_origin_with_a_key_and_one_not_allowed(browser, other_origin):
    s = Server("--api-key", "k1", "--allowed-origins", f'["{other_origin}"]')
    try:
        r = ask_from(browser, other_origin, s.url, "k1")  # Authorization: the browser sends a preflight first
        assert r.get("status") == 200 and "data: [DONE]" in r["text"], r
        r = ask_from(browser, other_origin, s.url, "wrong")  # the 401 is readable too
        assert r.get("status") == 401 and "invalid_api_key" in r["text"], r
    finally:
        s.stop()
    s = Server("--allowed-origins", "[]")
    try:
        r = ask_from(browser, other_origin, s.url, None)
        assert "error" in r and "Failed to fetch" in r["error"], r
    finally:
        s.stop()


def test_preflight_headers(other_origin):
    s = Server("--api-key", "k1", "--allowed-origins", f"{other_origin}, http://localhost:3000")
    try:
        pre = {"Origin": other_origin, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
        r = requests.options(s.url + "/v1/chat/completions", headers=pre)
        assert r.status_code == 204  # not a 401: a preflight never carries the key
        assert r.headers["Access-Control-Allow-Origin"] == other_origin
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        # a browser app may delete its stored responses (DELETE was left out; a black-box test)
        d = requests.options(s.url + "/v1/responses/resp_1", headers={**pre, "Access-Control-Request-Method": "DELETE"})
        assert d.status_code == 204 and "DELETE" in d.headers["Access-Control-Allow-Methods"]
        assert r.headers["Access-Control-Allow-Headers"].lower() == "authorization,content-type"
        r = requests.options(s.url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
        assert r.status_code == 204 and "Access-Control-Allow-Origin" not in r.headers
        r = requests.get(s.url + "/v1/models", headers={"Origin": other_origin, "Authorization": "Bearer k1"})
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == other_origin
        assert r.headers["Vary"] == "Origin"
        r = requests.get(s.url + "/v1/models", headers={"Authorization": "Bearer k1"})  # no Origin: no CORS headers
        assert "Access-Control-Allow-Origin" not in r.headers
    finally:
        s.stop()
