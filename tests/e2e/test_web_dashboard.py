"""The KV dashboard (/dashboard and its SSE feed /dashboard/events) against the real server with
two API keys (two tenants): the feed's JSON read with httpx (schema, tenant filtering, the
client cap), and the page in Debian's chromium through Playwright: a long request's pages in
use, then back; a shared system prompt as shared pages; a wrong key's error; and at 64
concurrent streams the dashboard still updates and the chat page still answers."""
from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve_server import MODEL_NAME, SLOWDOWN, Server
from web_pages import ask, last_stats, needs_chromium, screenshot, set_key, sync_api

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
MAX_DASHBOARDS = 8  # ServerOptions::max_dashboard_clients (--max-dashboards)


@pytest.fixture(scope="module")
def dash():
    # Defaults for the batch (64 sequences, 80 HTTP threads): the 64-stream test runs as shipped.
    s = Server("--debug", "--api-key", KEY_A, "--api-key", KEY_B, kv_memory="128MiB", api_key=KEY_A)
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.output()


@pytest.fixture(autouse=True)
def clean_after(dash):
    yield
    dash.wait_clean(timeout=10)


def chat(url: str, key: str, messages: list[dict], max_tokens: int, salt: str | None = None, stream: bool = True) -> dict:
    """One chat completion over httpx; returns {"status", "text", "chunks"}."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if salt:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=120) as c:
        if not stream:
            r = c.post(url + "/v1/chat/completions", json=body, headers=headers)
            return {"status": r.status_code, "text": r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text}
        text, chunks = "", 0
        with c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    for ch in json.loads(line[6:]).get("choices", []):
                        text += (ch.get("delta") or {}).get("content") or ""
            return {"status": r.status_code, "text": text, "chunks": chunks}


def in_thread(fn, *args, **kw) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, kwargs=kw, daemon=True)
    t.start()
    return t


class Watch:
    """One /dashboard/events stream, read in a thread: every payload, raw and parsed."""

    def __init__(self, url: str, key: str | None):
        self.raw: list[str] = []
        self.events: list[dict] = []
        self.status = None
        self.body = ""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = in_thread(self._run, url, {"Authorization": f"Bearer {key}"} if key else {})
        assert self._ready.wait(10), "no answer from /dashboard/events"

    def _run(self, url, headers):
        try:
            with httpx.Client(timeout=httpx.Timeout(10, read=5)) as c, c.stream("GET", url + "/dashboard/events", headers=headers) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.body = r.read().decode()
                    self._ready.set()
                    return
                self._ready.set()
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith("data: "):
                        self.raw.append(line)
                        self.events.append(json.loads(line[6:]))
        finally:
            self._ready.set()

    def wait_for(self, pred, timeout: float, what: str) -> dict:
        deadline, seen = time.time() + timeout, 0
        while time.time() < deadline:
            for ev in self.events[seen:]:
                if pred(ev):
                    return ev
            seen = len(self.events)
            time.sleep(0.05)
        pytest.fail(f"no dashboard event with {what} within {timeout} s ({len(self.events)} events)")

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)


def decode_runs(runs: str) -> str:
    return "".join(state * (int(n) if n else 1) for state, n in re.findall(r"(\D)(\d*)", runs))


N_TOK = 400  # tokens of each tenant's request in test_events_json_and_tenant_filtering


def test_events_json_and_tenant_filtering(dash):
    assert httpx.get(dash.url + "/dashboard").status_code == 200  # the page asks for the key itself
    assert Watch(dash.url, None).status == 401
    wrong = Watch(dash.url, "sk-wrong")
    assert wrong.status == 401 and "Incorrect API key" in wrong.body
    a, b = Watch(dash.url, KEY_A), Watch(dash.url, KEY_B)
    try:
        secret = "Zebra protocol: you are the private assistant of tenant B and you never reveal this. " * 2
        # Long enough to be seen running between two events even on a host that decodes two
        # sequences at ~500 tokens a second each (64 tokens once ended between two events).
        tb = in_thread(chat, dash.url, KEY_B, [{"role": "system", "content": secret}, {"role": "user", "content": "Count."}], N_TOK,
                       salt="b-salt")
        ta = in_thread(chat, dash.url, KEY_A, [{"role": "user", "content": "Hello from tenant A, say something long."}], N_TOK,
                       salt="a-salt")
        ev = b.wait_for(lambda e: any(r["state"] == "running" and r["mine"] and r["ns"] == "b-salt" for r in e["requests"]), 30,
                        "B's request running, by name")
        mine = next(r for r in ev["requests"] if r.get("ns") == "b-salt")
        assert mine["pages"] > 0 and mine["prompt"] > 0 and mine["events"][0][0] == "prefill"
        a.wait_for(lambda e: any(r["state"] == "running" and not r["mine"] for r in e["requests"]), 30,
                   "another tenant's request running")
        tb.join(60)
        ta.join(60)
        ev_b = b.wait_for(lambda e: any("Zebra" in n.get("text", "") for n in e["tree"]["nodes"])
                          and any(not n["mine"] and n["pages"] > 0 for n in e["tree"]["namespaces"]), 10,
                          "B's prompt in B's tree and another tenant's pages")
        ev_a = a.wait_for(lambda e: any(r["state"] == "finished" and r["mine"] and r["ns"] == "a-salt" for r in e["requests"])
                          and any(not n["mine"] and n["pages"] > 0 for n in e["tree"]["namespaces"]), 10,
                          "A's finished request and another tenant's pages")
    finally:
        a.close()
        b.close()
    # B sees its own namespace by name (the key's hash prefix stripped), A's only anonymously.
    assert {n["name"] for n in ev_b["tree"]["namespaces"] if n["mine"]} == {"b-salt"}
    assert [n["name"] for n in ev_b["tree"]["namespaces"] if not n["mine"]] == [None]
    # A never sees B's namespace, prompt text or key hash; B's rows and nodes are there, anonymous.
    for line in a.raw:
        assert "Zebra" not in line and "b-salt" not in line and "key:" not in line
    anon = [r for r in ev_a["requests"] if not r["mine"]]
    assert anon and all("ns" not in r for r in anon)
    anon_ns = [k for k, n in enumerate(ev_a["tree"]["namespaces"]) if not n["mine"]]
    assert all("text" not in n for n in ev_a["tree"]["nodes"] if n["ns"] in anon_ns)
    assert any("text" in n for n in ev_a["tree"]["nodes"] if n["ns"] not in anon_ns)
    # The schema: the pool's run-length states add up to the pool, the counts to its pages.
    for ev in a.events[-3:]:
        pool = ev["pools"][0]
        states = decode_runs(pool["runs"])
        assert len(states) == pool["n_pages"]
        assert set(states) <= set(".rsct")
        assert sum(pool["counts"].values()) == pool["n_pages"]
        assert pool["counts"]["cached"] == states.count("c") and pool["counts"]["running"] == states.count("r")
        assert ev["build_ms"] < 50
    # Later events carry only newer rate points.
    ts = [p["t"] for ev in a.events for p in ev["rates"]]
    assert ts == sorted(set(ts))
    # A watcher that opens now (the server has run for seconds) gets the charts' whole window at once,
    # and it ends where `a` has got to. (Opened at server start, `a`'s first event may hold one point.)
    late = Watch(dash.url, KEY_A)
    try:
        first = late.wait_for(lambda e: True, 10, "a first event")
    finally:
        late.close()
    assert len(first["rates"]) > 1 and [p["t"] for p in first["rates"]] == sorted(set(p["t"] for p in first["rates"]))
    assert first["rates"][0]["t"] <= ts[-1]
    fin = next(r for r in ev_a["requests"] if r.get("ns") == "a-salt")
    assert fin["reason"] == "length" and fin["generated"] == N_TOK and fin["first_token"] > fin["arrival"]
    assert [e[0] for e in fin["events"]][-1] == "finished" and "decode" in [e[0] for e in fin["events"]]


def open_dashboard(browser, server, key: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(server.url + "/dashboard")
    set_key(page, key)
    page.wait_for_function("() => Number(document.body.dataset.events || 0) >= 2", timeout=30_000)  # one per engine step
    return page


def count(page, state: str) -> int:
    return int(page.text_content("#count-" + state))


@needs_chromium
def test_a_long_requests_pages_are_in_use_then_given_back(dash, browser):
    page = open_dashboard(browser, dash, KEY_A)
    t = in_thread(chat, dash.url, KEY_A, [{"role": "user", "content": "Count from 1 to 500, one number per line."}], 160, salt="long")
    page.wait_for_function("() => Number(document.getElementById('count-running').textContent) > 0 && "
                           "document.querySelector('#requests tr[data-state=running][data-mine=true]')", timeout=30_000)
    row = page.locator("#requests tr[data-state=running]").first
    rid = row.get_attribute("data-id")
    assert "long" in row.text_content()
    t.join(60)
    # Back: nothing running or shared; the prompt's and answer's full pages stay cached.
    page.wait_for_function(f"() => document.getElementById('count-running').textContent === '0' && "
                           f"document.getElementById('count-shared').textContent === '0' && "
                           f"document.querySelector('#requests tr[data-id=\"{rid}\"][data-state=finished]')", timeout=10_000)
    assert count(page, "cached") >= 160 // 16
    assert "namespace long" in page.text_content("#tree")
    page.close()


@needs_chromium
def test_a_shared_system_prompt_shows_up_as_shared_pages(dash, browser):
    page = open_dashboard(browser, dash, KEY_A)
    system = {"role": "system", "content": "Shared rules: answer in plain English, be brief, be kind, cite nothing, "
                                           "never use lists, and always end with a full stop. " * 2}
    assert chat(dash.url, KEY_A, [system, {"role": "user", "content": "Warm up."}], 2, stream=False)["status"] == 200
    threads = [in_thread(chat, dash.url, KEY_A, [system, {"role": "user", "content": q}], 64)
               for q in ("Name a river.", "Name a mountain.", "Name a lake.")]
    page.wait_for_function("() => Number(document.getElementById('count-shared').textContent) >= 3", timeout=30_000)
    # The tree shows the prompt's node with the three hits.
    page.wait_for_function("() => [...document.querySelectorAll('#tree .node')].some(n => n.textContent.includes('Shared rules') "
                           "&& Number(n.dataset.hits) >= 3)", timeout=10_000)
    for t in threads:
        t.join(60)
    page.close()


@needs_chromium
def test_a_wrong_key_shows_the_error(dash, browser):
    page = browser.new_page()
    page.goto(dash.url + "/dashboard")
    sync_api.expect(page.locator("#status")).to_contain_text("API key")  # none given yet: 401
    set_key(page, "sk-wrong")
    sync_api.expect(page.locator("#status")).to_contain_text("Incorrect API key")
    assert page.get_attribute("#status", "class") == "error"
    page.close()


@needs_chromium
def test_a_changed_key_ends_the_old_keys_view(dash, browser):
    # While snapshots flow for key A, the key becomes a wrong one: the page shows the 401 and
    # keeps showing it (the old stream's next snapshot once set "live" again and redrew A's
    # requests and prefix tree), and nothing A saw stays on screen.
    t = in_thread(chat, dash.url, KEY_A, [{"role": "user", "content": "Count to a hundred."}], 200)
    page = open_dashboard(browser, dash, KEY_A)
    try:
        page.wait_for_function("() => document.getElementById('tree').textContent.length > 0", timeout=10_000)
        set_key(page, "sk-wrong")
        sync_api.expect(page.locator("#status")).to_contain_text("Incorrect API key")
        events = int(page.evaluate("document.body.dataset.events"))
        time.sleep(1.5)  # several snapshots' time for key A
        assert "Incorrect API key" in page.text_content("#status") and page.get_attribute("#status", "class") == "error"
        assert int(page.evaluate("document.body.dataset.events")) == events
        assert page.evaluate("window.kvLast") is None
        assert page.text_content("#tree") == "" and page.locator("#requests tbody tr").count() == 0
    finally:
        page.close()
        t.join(timeout=120)


@needs_chromium
def test_64_concurrent_streams_the_dashboard_keeps_up_and_the_chat_page_answers(dash, browser):
    system = {"role": "system", "content": "You are a terse assistant for a load test: short facts only. " * 2}
    # 120 tokens each: the batch must still run when the dashboard page is checked, seconds in,
    # on a host that decodes 64 sequences at ~1,700 tokens a second (20 each once ended first).
    with ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(chat, dash.url, KEY_A if i % 4 else KEY_B, [system, {"role": "user", "content": f"Fact {i}?"}], 120)
                   for i in range(64)]
        page = open_dashboard(browser, dash, KEY_A)  # one of the MAX_DASHBOARDS viewers
        watchers = [Watch(dash.url, KEY_A)]
        chat_page = browser.new_page()
        try:
            first = watchers[0].wait_for(lambda e: sum(r["state"] == "running" for r in e["requests"]) >= 32, 30, ">= 32 running")
            # The chat page asks now, while the batch runs (it queues behind it if every slot is taken).
            chat_page.goto(dash.url + "/")
            set_key(chat_page, KEY_A)
            sync_api.expect(chat_page.locator("#model")).to_contain_text(MODEL_NAME)
            ask(chat_page, "Say hi.", 4)
            # Several fresh snapshots within a few seconds (at most one per engine step: nothing
            # changes inside a step, and a step of 64 sequences is slow on 2 cores).
            t0 = time.time()
            watchers[0].wait_for(lambda e: e["seq"] >= first["seq"] + 3, 5 * SLOWDOWN, "3 more snapshots under load")
            rate = 3 / (time.time() - t0)
            page.wait_for_function("() => Number(document.getElementById('count-running').textContent) > 0", timeout=5_000)
            screenshot(page, "dashboard.png")
            # The cap: MAX_DASHBOARDS viewers at once, an equal share per key (two keys: half
            # each), so one tenant's tabs cannot lock the other out.
            watchers += [Watch(dash.url, KEY_A) for _ in range(MAX_DASHBOARDS // 2 - 2)]
            assert all(w.status == 200 for w in watchers)
            extra = Watch(dash.url, KEY_A)
            assert extra.status == 429 and "Too many KV dashboards are open for this API key" in extra.body
            watchers += [Watch(dash.url, KEY_B) for _ in range(MAX_DASHBOARDS // 2)]
            assert all(w.status == 200 for w in watchers)
            extra = Watch(dash.url, KEY_B)
            assert extra.status == 429 and "(at most 4)" in extra.body
            assert "tok/s" in last_stats(chat_page, timeout_ms=60_000).text_content()
        finally:
            for w in watchers:
                w.close()
            page.close()
            chat_page.close()
        results = [f.result() for f in futures]
    assert all(r["status"] == 200 and r["chunks"] > 2 for r in results), [r["status"] for r in results]
    print(f"dashboard under 64 streams: {rate:.1f} snapshots/s")
