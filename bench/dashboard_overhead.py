"""What watching the KV dashboard costs the engine: 64 concurrent streaming requests, with no
dashboard open and with the maximum (8) open, alternating; prints generated tokens/s per round,
the server's CPU seconds per round (the engine's threads spin between jobs, so
compare rounds, not the absolute number), and from the dashboards' own payloads the snapshot build time (engine-thread ms) and size.

    python3 bench/dashboard_overhead.py [--kv-memory 2GiB] [--rounds 2] [--requests 64] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from kvserve_server import MODEL_NAME, Server  # noqa: E402

WORDS = "apple river stone cloud market engine silver garden window yellow bridge forest candle ocean letter".split()


def one(url: str, prompt: str, max_tokens: int) -> int:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    n = 0
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            n += line.startswith("data: {")
    return n


def watch(url: str, stop: threading.Event, out: list):
    with httpx.Client(timeout=httpx.Timeout(10, read=5)) as c, c.stream("GET", url + "/dashboard/events") as r:
        for line in r.iter_lines():
            if stop.is_set():
                return
            if line.startswith("data: "):
                j = json.loads(line[6:])
                out.append((j["build_ms"], len(line), j["pools"][0]["n_pages"], j["tree"]["nodes_total"]))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def round_(url: str, pid: int, n_req: int, max_tokens: int, n_dash: int, rng: random.Random) -> dict:
    stop, seen, threads = threading.Event(), [], []
    for _ in range(n_dash):
        t = threading.Thread(target=watch, args=(url, stop, seen), daemon=True)
        t.start()
        threads.append(t)
    time.sleep(0.5)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(n_req)]  # distinct: a tree of many nodes
    t0, cpu0 = time.time(), cpu_seconds(pid)
    with ThreadPoolExecutor(n_req) as ex:
        list(ex.map(lambda p: one(url, p, max_tokens), prompts))
    wall, cpu = time.time() - t0, cpu_seconds(pid) - cpu0
    stop.set()
    for t in threads:
        t.join(10)
    # CPU seconds of the server per round: what the dashboards cost it, whatever else the machine runs.
    out = {"dashboards": n_dash, "wall_s": round(wall, 2), "server_cpu_s": round(cpu, 2), "gen_tok_s": round(n_req * max_tokens / wall, 1)}
    if seen:
        builds = sorted(b for b, *_ in seen)
        out.update(snapshots=len(seen), build_ms_median=builds[len(builds) // 2], build_ms_max=builds[-1],
                   payload_kb_median=round(statistics.median(s for _, s, *_ in seen) / 1024, 1),
                   pages=seen[-1][2], tree_nodes=max(n for *_, n in seen))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-memory", default="2GiB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    s = Server(kv_memory=a.kv_memory, max_model_len=1024)
    rng = random.Random(1)
    try:
        for _ in range(a.rounds):
            for n_dash in (0, 8):
                print(json.dumps(round_(s.url, s.proc.pid, a.requests, a.max_tokens, n_dash, rng)), flush=True)
    finally:
        s.stop()


if __name__ == "__main__":
    main()
