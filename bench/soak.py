#!/usr/bin/env python3
"""Soak: many concurrent clients against one real `kvserve serve` on loopback, for minutes.

Each client loops: a random request (completions or chat, streamed or not; temperature, top_p,
top_k, min_p, penalties, seed, n, stop strings, max_tokens, prompt length, a cache salt from a
few tenants, a shared system prefix or not; 3% are long generations under a KV eviction policy
that go past --max-model-len, re-indexing), and 20% of the time it disconnects on purpose at a
random point (mid-stream, or a non-streamed request given up after a random wait).

Pass (exit 0) when:
  - no 5xx and no other failure: every request is answered in full (all choices finished, and
    [DONE] for a stream) or was cancelled by its own client;
  - resident memory is flat after warm-up: the largest RSS after the warm-up is within 5% of the
    RSS at the end of the warm-up;
  - when all clients are done, pages in use return to 0 and the pool's integrity check passes.

    python3 bench/soak.py                         # 64 clients, 10 minutes
    python3 bench/soak.py --clients 16 --duration 60

Writes bench/out/soak.json and bench/out/soak.png (RSS, throughput, outcomes over time).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("cache page token attention memory server request stream model layer tenant prefix radix batch "
         "decode prefill latency throughput kernel vector matrix budget window sink eviction tier disk redis").split()
SYSTEMS = [" ".join(random.Random(i).choice(WORDS) for _ in range(120)) for i in range(4)]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Stats:
    def __init__(self):
        self.outcomes: dict[str, int] = {}
        self.failures: list[str] = []
        self.tokens = 0
        self.timeline: list[dict] = []

    def count(self, what: str):
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def fail(self, what: str):
        self.count("failed")
        if len(self.failures) < 50:
            self.failures.append(what)


def random_request(rng: random.Random, model: str) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    n_words = int(rng.choice([5, 20, 80, 300, 700]) * rng.uniform(0.5, 1.0))
    text = " ".join(rng.choice(WORDS) for _ in range(n_words))
    if rng.random() < 0.5:  # a shared system prefix: prefix-cache hits across clients
        text = rng.choice(SYSTEMS) + "\n" + text
    body: dict = {"model": model, "max_tokens": rng.choice([1, 8, 32, 64, 128]), "stream": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if rng.random() < 0.7:
        body["temperature"] = round(rng.uniform(0, 1.5), 2)
        if rng.random() < 0.5:
            body["top_p"] = round(rng.uniform(0.5, 1.0), 2)
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([5, 40, 200])
        if rng.random() < 0.2:
            body["min_p"] = 0.05
        if rng.random() < 0.3:
            body["presence_penalty"] = 0.5
            body["frequency_penalty"] = 0.3
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(1 << 31)
    else:
        body["temperature"] = 0
    if rng.random() < 0.3:
        body["n"] = rng.choice([2, 3, 4])
    if rng.random() < 0.3:
        body["stop"] = rng.sample([".", "\n", " the", "cache", "!!"], rng.randint(1, 3))
    if rng.random() < 0.5:
        body["cache_salt"] = f"tenant-{rng.randrange(4)}"
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.03:  # past max_model_len (2048): a long prompt, an evicting policy, re-indexing
        words = " ".join(rng.choice(WORDS) for _ in range(700))
        if chat:
            body["messages"] = [{"role": "user", "content": words}]
        else:
            body["prompt"] = words
        body["max_tokens"] = rng.choice([1200, 1400])
        body["n"] = 1
        body["kv_eviction"] = {"policy": rng.choice(["sinks", "h2o", "snapkv", "window"]), "budget": rng.choice([256, 512])}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def one_request(client: httpx.AsyncClient, url: str, path: str, body: dict, rng: random.Random, stats: Stats,
                      disconnect: bool):
    n = body.get("n", 1)
    if body["stream"]:
        give_up_after = rng.randint(0, 40) if disconnect else None
        finished: set[int] = set()
        done = False
        chunks = 0
        try:
            async with client.stream("POST", url + path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    stats.fail(f"stream status {r.status_code}: {r.text[:200]}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    if payload == "[DONE]":
                        done = True
                        break
                    ev = json.loads(payload)
                    if "error" in ev:
                        stats.fail(f"error event: {ev['error']}")
                        return
                    for c in ev.get("choices", []):
                        if c.get("finish_reason"):
                            finished.add(c["index"])
                        stats.tokens += 1 if (c.get("text") or (c.get("delta") or {}).get("content")) else 0
                    chunks += 1
                    if give_up_after is not None and chunks >= give_up_after:
                        stats.count("cancelled_by_client")
                        return  # leaving the context closes the connection mid-stream
        except httpx.HTTPError as e:
            stats.fail(f"stream transport: {type(e).__name__}: {e}")
            return
        if give_up_after is not None and not done:
            stats.fail("stream ended early")
            return
        if not done or finished != set(range(n)):
            stats.fail(f"stream incomplete: done={done} finished={sorted(finished)} n={n}")
            return
        stats.count("stream_ok")
        return
    try:
        timeout = rng.uniform(0.05, 2.0) if disconnect else 300
        r = await client.post(url + path, json=body, timeout=timeout)
    except httpx.TimeoutException:
        if disconnect:
            stats.count("cancelled_by_client")
        else:
            stats.fail("non-streamed request timed out")
        return
    except httpx.HTTPError as e:
        stats.fail(f"transport: {type(e).__name__}: {e}")
        return
    if r.status_code != 200:
        stats.fail(f"status {r.status_code}: {r.text[:200]}")
        return
    j = r.json()
    if len(j["choices"]) != n or any(c.get("finish_reason") not in ("stop", "length") for c in j["choices"]):
        stats.fail(f"bad answer: {json.dumps(j)[:200]}")
        return
    stats.tokens += j["usage"]["completion_tokens"]
    stats.count("ok" if not disconnect else "ok_before_disconnect")


async def client_loop(i: int, url: str, model: str, deadline: float, stats: Stats, disconnect_rate: float):
    rng = random.Random(1000 + i)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        while time.time() < deadline:
            path, body = random_request(rng, model)
            disconnect = rng.random() < disconnect_rate
            await one_request(client, url, path, body, rng, stats, disconnect)


async def monitor(pid: int, url: str, deadline: float, stats: Stats, t0: float):
    async with httpx.AsyncClient(timeout=30) as c:
        last_tokens = 0
        last_t = time.time()
        while time.time() < deadline:
            await asyncio.sleep(5)
            now = time.time()
            kv = (await c.get(url + "/debug/kv")).json()
            stats.timeline.append({"t": round(now - t0, 1), "rss": rss_bytes(pid), "pages_in_use": kv["pages_in_use"],
                                   "running": kv["num_requests_running"], "waiting": kv["num_requests_waiting"],
                                   "tok_s": round((stats.tokens - last_tokens) / (now - last_t), 1),
                                   "failed": stats.outcomes.get("failed", 0)})
            last_tokens, last_t = stats.tokens, now
            p = stats.timeline[-1]
            print(f"[soak] {p['t']:6.0f} s  rss {p['rss'] / 2**20:7.1f} MiB  pages {p['pages_in_use']:5d}  running {p['running']:3d}"
                  f"  waiting {p['waiting']:3d}  {p['tok_s']:7.1f} tok/s  outcomes {stats.outcomes}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=os.path.join(ROOT, "build", "kvserve"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--warmup", type=float, default=120, help="seconds before the RSS baseline")
    ap.add_argument("--disconnect-rate", type=float, default=0.2)
    ap.add_argument("--kv-cache-memory", default="128MiB")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "soak.json"))
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [args.kvserve, "serve", "-m", args.model, "--port", str(port), "--debug", "--max-num-seqs", "64",
           "--max-model-len", "2048", "--kv-cache-memory", args.kv_cache_memory, "--max-queue", "512"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        stats = Stats()
        t0 = time.time()
        deadline = t0 + args.duration
        print(f"[soak] {args.clients} clients for {args.duration:.0f} s against {url} (pid {proc.pid})", flush=True)

        async def run():
            await asyncio.gather(monitor(proc.pid, url, deadline, stats, t0),
                                 *(client_loop(i, url, model, deadline, stats, args.disconnect_rate) for i in range(args.clients)))

        asyncio.run(run())
        # Clients are done: every page must come back, and the pool must check out.
        end = time.time() + 30
        kv = httpx.get(url + "/debug/kv").json()
        while kv["pages_in_use"] != 0 and time.time() < end:
            time.sleep(0.2)
            kv = httpx.get(url + "/debug/kv").json()
        metrics = httpx.get(url + "/metrics").text
        rss_end = rss_bytes(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    after = [p["rss"] for p in stats.timeline if p["t"] >= args.warmup]
    base = next((p["rss"] for p in stats.timeline if p["t"] >= args.warmup), stats.timeline[-1]["rss"] if stats.timeline else 0)
    growth = (max(after) - base) / base if after and base else 0.0
    preempt = [l for l in metrics.splitlines() if l.startswith("kvserve:num_preemptions_total")]
    reindexed = [l for l in metrics.splitlines() if l.startswith("kvserve:kv_reindexed_tokens_total")]
    result = {
        "clients": args.clients, "duration_s": args.duration, "disconnect_rate": args.disconnect_rate,
        "kv_cache_memory": args.kv_cache_memory, "outcomes": stats.outcomes, "failures": stats.failures,
        "completion_tokens_seen": stats.tokens,
        "tok_s_median": statistics.median([p["tok_s"] for p in stats.timeline]) if stats.timeline else 0,
        "rss_warm_bytes": base, "rss_max_after_warmup_bytes": max(after) if after else 0, "rss_end_bytes": rss_end,
        "rss_growth_after_warmup": round(growth, 4), "pages_in_use_at_end": kv["pages_in_use"],
        "integrity": kv["integrity"], "preemptions": preempt, "reindexed_positions": reindexed,
        "server_exit_code": proc.returncode,
        "timeline": stats.timeline,
    }
    ok = (stats.outcomes.get("failed", 0) == 0 and growth <= 0.05 and kv["pages_in_use"] == 0 and kv["integrity"]["ok"]
          and proc.returncode == 0)
    result["pass"] = ok
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out.replace(".json", ".png"), args.warmup)
    print(json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=1))
    print("[soak] PASS" if ok else "[soak] FAIL")
    if not ok:
        log.flush()
        print(open(log.name).read()[-3000:])
    sys.exit(0 if ok else 1)


def plot(result: dict, path: str, warmup: float):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tl = result["timeline"]
    if not tl:
        return
    t = [p["t"] for p in tl]
    fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ax[0].plot(t, [p["rss"] / 2**20 for p in tl])
    ax[0].axvline(warmup, color="gray", ls="--", lw=0.8)
    ax[0].set_ylabel("server RSS (MiB)")
    ax[0].set_title(f"kvserve soak: {result['clients']} clients, {result['disconnect_rate']:.0%} disconnecting, "
                    f"RSS growth after warm-up {result['rss_growth_after_warmup']:.1%}")
    ax[1].plot(t, [p["tok_s"] for p in tl])
    ax[1].set_ylabel("completion tok/s (seen)")
    ax[2].plot(t, [p["pages_in_use"] for p in tl], label="pages in use")
    ax[2].plot(t, [p["running"] for p in tl], label="running")
    ax[2].plot(t, [p["waiting"] for p in tl], label="waiting")
    ax[2].set_xlabel("seconds")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
