"""The chat page at / in a real browser: Playwright driving Debian's chromium, headless, against
the real server. A round trip streams the same text the API gives for the same request; the
second turn shows cached prompt tokens; stop cancels the request on the server (its pages come
back); a wrong API key shows the server's error, the right one works."""
from __future__ import annotations

import os
import time

from kvserve_server import ABORTED_CLIENT, MODEL_NAME, Server
from web_pages import ROOT, ask, last_stats, needs_chromium, screenshot, set_key, sync_api

pytestmark = needs_chromium
GEMMA = os.path.join(ROOT, "models", "gemma-3-270m-Q4_K_M.gguf")


def test_a_chat_round_trip_streams_the_apis_answer(server, client, browser):
    page = browser.new_page()
    page.goto(server.url + "/")
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
    ask(page, "Name three rivers.", 24)
    stats = last_stats(page)
    assert "tok/s" in stats.text_content(), stats.text_content()
    body = page.locator(".assistant .body").last
    shown = body.get_attribute("data-raw")
    want = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Name three rivers."}],
                                          temperature=0, top_p=0.95, max_tokens=24).choices[0].message.content
    assert shown == want and shown
    # shown as Markdown: the text the browser shows is marked's rendering of the answer
    assert body.inner_html() == page.evaluate("(t) => marked.parse(t)", want)
    if any(line[:3] in ("1. ", "- ", "* ") for line in want.splitlines()):
        assert body.locator("li").count() > 0
    # The second turn resends the conversation: its prefix comes from the prefix cache.
    ask(page, "And three mountains?", 8)
    page.wait_for_function("() => document.querySelectorAll('.assistant .stats').length == 2 && "
                           "document.querySelectorAll('.assistant .stats')[1].textContent", timeout=60_000)
    assert int(page.locator(".assistant .stats").last.get_attribute("data-cached")) > 0
    screenshot(page, "chat.png")
    page.close()


def test_answers_render_as_markdown_without_running_their_html(server, browser):
    """The model's text is untrusted: Markdown renders (marked, served by the server itself), but
    raw HTML shows as text, script links and images do not become live elements."""
    page = browser.new_page()
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(server.url + "/")
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
    md = ("**bold** and `x<y`\n\n1. one\n2. two\n\n```\n<b>code</b>\n```\n\n"
          "<img src=x onerror=\"window.pwned=1\"> <script>window.pwned=2</script> [click](javascript:window.pwned=3) "
          "![pic](http://example.invalid/p.png) [ok](https://example.org)")
    page.evaluate("(t) => { const d = document.createElement('div'); d.id = 'probe'; d.innerHTML = renderMarkdown(t); "
                  "document.body.appendChild(d); }", md)
    probe = page.locator("#probe")
    assert probe.locator("strong").text_content() == "bold"
    assert probe.locator("li").count() == 2 and probe.locator("pre code").text_content() == "<b>code</b>\n"
    assert probe.locator("img, script, b").count() == 0
    hrefs = probe.locator("a").evaluate_all("(as) => as.map((a) => a.getAttribute('href'))")
    assert hrefs == ["http://example.invalid/p.png", "https://example.org"], hrefs
    assert "<img src=x" in probe.text_content() and "<script>" in probe.text_content()
    assert page.evaluate("window.pwned") is None
    # the script is the server's own, with no key needed (the page asks for one later)
    import requests
    r = requests.get(server.url + "/marked.min.js", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/javascript") and "marked" in r.text[:200]
    assert errors == [], errors
    page.close()


def test_the_token_count_is_the_servers_tokenizer(server, browser):
    # While typing, the page shows the conversation's size as POST /tokenize counts it (the chat
    # template included), against the model's context.
    import requests
    page = browser.new_page()
    page.goto(server.url + "/")
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
    text = "How many tokens is this sentence, with the template around it?"
    page.fill("#input", text)
    page.dispatch_event("#input", "input")
    page.wait_for_function("() => document.getElementById('tokens').textContent.includes('tokens of')", timeout=10_000)
    want = requests.post(server.url + "/tokenize", timeout=10, json={
        "messages": [{"role": "user", "content": text}], "add_generation_prompt": True}).json()
    assert page.locator("#tokens").text_content() == f"{want['count']} tokens of {want['max_model_len']}"
    assert want["count"] > len(text.split())  # the template's tokens are counted too
    page.close()


def test_the_kv_eviction_select_sends_the_policy_and_the_dashboard_is_linked(server, browser):
    page = browser.new_page()
    page.goto(server.url + "/")
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
    page.select_option("#kv_policy", "sinks")
    page.fill("#kv_budget", "128")
    ask(page, "Say hello.", 6)
    assert "KV sinks budget 128" in last_stats(page).text_content()
    with page.context.expect_page() as opened:
        page.click("#dashboard-link")  # a new tab
    dash = opened.value
    dash.wait_for_load_state()
    assert dash.url == server.url + "/dashboard"
    sync_api.expect(dash.locator("h1")).to_contain_text("KV dashboard")
    dash.close()
    page.close()


def test_stop_cancels_the_request_on_the_server(server, browser):
    page = browser.new_page()
    page.goto(server.url + "/")
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
    before = server.metrics().get(ABORTED_CLIENT, 0)
    ask(page, "Count from 1 to 500, one number per line.", 400)
    page.wait_for_function("() => { const b = document.querySelectorAll('.assistant .body'); return b.length && "
                           "b[b.length - 1].textContent.length > 10; }", timeout=60_000)
    assert server.debug_kv()["pages_in_use"] > 0
    page.click("#stop")
    assert last_stats(page).text_content() == "stopped"
    t0 = time.time()
    while server.debug_kv()["pages_in_use"] != 0:
        assert time.time() - t0 < 3, "the server kept running the stopped request"
        time.sleep(0.05)
    while server.metrics().get(ABORTED_CLIENT, 0) < before + 1:
        assert time.time() - t0 < 5
        time.sleep(0.05)
    page.close()


def test_a_wrong_api_key_shows_the_error_and_the_right_one_works(browser):
    s = Server("--api-key", "sk-right")
    try:
        page = browser.new_page()
        page.goto(s.url + "/")
        sync_api.expect(page.locator("#model")).to_contain_text("API key")  # /v1/models answered 401
        set_key(page, "sk-wrong")
        ask(page, "hi", 4)
        assert "Incorrect API key" in last_stats(page).text_content()
        set_key(page, "sk-right")
        sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
        ask(page, "hi", 4)
        page.wait_for_function("() => document.querySelectorAll('.assistant .stats')[1] && "
                               "document.querySelectorAll('.assistant .stats')[1].textContent.includes('tok/s')", timeout=60_000)
        # The key is kept in the page (localStorage) across a reload.
        page.reload()
        assert page.input_value("#apikey") == "sk-right"
        page.close()
    finally:
        s.stop()


def test_the_sampling_fields_and_the_enter_key_send_what_the_user_means(server, browser):
    """A blank field is left out of the request (the server's default), not sent as 0; a value out
    of a field's range stops the send and keeps the message; Enter that confirms an input
    method's composition does not send; a one-token answer shows no rate ("–"): its one token
    has no inter-token time (the page once showed 166 tok/s)."""
    page = browser.new_page()
    page.goto(server.url + "/")
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
    sent = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    page.fill("#temperature", "")
    page.fill("#max_tokens", "1")
    page.fill("#input", "Say yes.")
    page.click("#send")
    stats = last_stats(page).text_content()
    assert "temperature" not in sent[0] and sent[0]["max_tokens"] == 1 and sent[0]["top_p"] == 0.95, sent[0]
    assert stats.startswith("1 tokens · – tok/s"), stats
    # Out of range: nothing is sent, the message stays in the box.
    page.fill("#temperature", "5")
    page.fill("#input", "Again.")
    page.click("#send")
    time.sleep(0.5)
    assert len(sent) == 1 and page.input_value("#input") == "Again."
    # Enter while composing (keyCode 229, isComposing) confirms the composition only.
    page.fill("#temperature", "0")
    page.evaluate("""() => document.getElementById('input').dispatchEvent(new KeyboardEvent('keydown',
                       { key: 'Enter', keyCode: 229, isComposing: true, bubbles: true, cancelable: true }))""")
    time.sleep(0.5)
    assert len(sent) == 1 and page.input_value("#input") == "Again."
    page.close()


def test_a_model_without_a_chat_template_continues_text(browser):
    """Gemma 3 270M's GGUF has no chat template: /v1/models says so, the page says so and sends
    the text as a completion (it once sent chat requests that all failed), and the banner's
    curl example is a completion."""
    s = Server(model=GEMMA, kv_memory="32MiB", max_model_len=1024)
    try:
        banner = s.output().split("try:")[1]
        assert "/v1/completions -H" in banner and "/v1/chat/completions" not in banner, banner
        page = browser.new_page()
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(s.url + "/")
        sync_api.expect(page.locator("#mode")).to_be_visible()
        sent = []
        page.on("request", lambda r: sent.append(r.url) if "/v1/" in r.url and r.method == "POST" else None)
        ask(page, "The capital of France is", 4)
        stats = last_stats(page).text_content()
        assert "error" not in stats and sent == [s.url + "/v1/completions"], (stats, sent)
        assert page.locator(".assistant .body").last.text_content()
        assert page.locator(".assistant .body.md").count() == 0  # a continuation stays raw text
        assert errors == [], errors
        page.close()
    finally:
        s.stop()


def test_new_chat_forgets_the_conversation(server, browser):
    """A conversation that filled the context had no way out but a reload (a user test): New chat
    empties the log, and the next message is sent alone (its prompt as short as the first's)."""
    page = browser.new_page()
    page.goto(server.url + "/")
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
    ask(page, "Name a colour.", 6)
    first = last_stats(page).text_content()
    ask(page, "Name a colour.", 6)
    page.wait_for_function("() => document.querySelectorAll('.assistant .stats').length == 2 && "
                           "document.querySelectorAll('.assistant .stats')[1].textContent", timeout=60_000)
    second = page.locator(".assistant .stats").last.text_content()
    prompt = lambda s: int(s.split(" · prompt ")[1].split(" ")[0])
    assert prompt(second) > prompt(first)
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    ask(page, "Name a colour.", 6)
    assert prompt(last_stats(page).text_content()) == prompt(first)
    page.close()


def test_the_pages_work_behind_a_path_prefix(server, browser):
    """Behind a reverse proxy that serves kvserve under /kv/, the pages called /v1/models and the
    rest at the origin's root and got 404s (a user test). Their requests are relative now."""
    import asyncio
    import threading

    import aiohttp
    from aiohttp import web

    async def forward(request):  # as a proxy would: the body decoded, streamed as it comes
        async with aiohttp.ClientSession() as s:
            async with s.request(request.method, server.url + "/" + request.match_info["tail"], data=await request.read(),
                                 headers={k: v for k, v in request.headers.items() if k.lower() not in ("host", "accept-encoding")}) as up:
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

    # The proxy's loop runs on its own thread: Playwright keeps one running on this one.
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    def serve():
        asyncio.set_event_loop(loop)
        app = web.Application()
        app.router.add_route("*", "/kv/{tail:.*}", forward)
        box["runner"] = web.AppRunner(app)
        loop.run_until_complete(box["runner"].setup())
        site = web.TCPSite(box["runner"], "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["port"] = site._server.sockets[0].getsockname()[1]
        started.set()
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert started.wait(10)
    port, runner = box["port"], box["runner"]
    try:
        page = browser.new_page()
        page.goto(f"http://127.0.0.1:{port}/kv/")
        sync_api.expect(page.locator("#model")).to_contain_text(MODEL_NAME)
        ask(page, "Say hello.", 6)
        assert "6 tokens" in last_stats(page).text_content()
        dash = browser.new_page()
        dash.goto(f"http://127.0.0.1:{port}/kv/dashboard")
        sync_api.expect(dash.locator("h1")).to_contain_text("KV dashboard")
        dash.wait_for_function("() => !document.body.textContent.includes('404')", timeout=10_000)
        dash.close()
        page.close()
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
