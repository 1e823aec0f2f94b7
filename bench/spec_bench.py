#!/usr/bin/env python3
"""Speculative decoding benchmark (docs/speculative.md): decode speed with and without drafts.

At batch 1, three workloads through the real server (`kvserve serve`, streaming chat):
  code      rewrite a given source file with one small change (the answer copies the file),
  document  answer questions by quoting a given document,
  chat      open chat (a story: nothing to copy).
Each runs with "speculative": false, the ngram method and the suffix method (one server; the
method is chosen per request; the suffix method's namespace cache is cleared between repeats by
a fresh cache_salt). Decode tok/s = (completion tokens - 1) / (last chunk - first chunk);
the acceptance rate comes from the server's kvserve:spec_decode_* counters.

The peer, in the same run: llama.cpp's prompt-lookup decoding (`llama-lookup`, greedy) and its
plain decoding (`llama-completion`) on the same rendered prompt, when built
(`LLAMA_WITH_LOOKUP=1 bench/peer/build_llama.sh`).

--model picks the GGUF (SmolLM2 by default); a Gemma 3 GGUF, which carries no chat template,
gets --chat-template gemma3 unless one is given. The peer gets the rendered prompt without its
BOS (llama.cpp adds the model's own).

Then 16 users (closed loop, the three workloads in turn, temperature 0.7 with seeds) with the
server's default speculation (ngram, max_batch_tokens 8: drafts only while the batch is narrow)
against "speculative": false: aggregate generated tok/s.

Output: bench/out/spec_bench.json and bench/out/spec_bench.png (copied to docs/spec_bench.png).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import ROOT, DEFAULT_MODEL, Server, free_port, log, scrape_metrics, sse_events  # noqa: E402

PEER_BIN = ROOT / "bench" / "peer" / "work" / "build" / "bin"
OUT = ROOT / "bench" / "out"


def code_prompt() -> list[dict]:
    src = (ROOT / "bench" / "serve_bench.py").read_text().splitlines()
    lo = next(i for i, l in enumerate(src) if l.startswith("def free_port"))
    code = "\n".join(src[lo:lo + 62])
    return [{"role": "user", "content": "Here is a Python file:\n\n```python\n" + code + "\n```\n\n"
             "Rewrite the whole file with the function `http_get` renamed to `fetch_url`. "
             "Output only the code."}]


def document_prompt() -> list[dict]:
    path = ROOT / "data" / "text" / "pride_and_prejudice.txt"
    text = path.read_text(errors="replace") if path.exists() else ""
    at = text.find("It is a truth universally acknowledged")
    doc = " ".join(text[at:at + 3000].split()) if at >= 0 else " ".join(["The committee met on Monday."] * 60)
    return [{"role": "system", "content": "Answer using exact quotes from the document."},
            {"role": "user", "content": "Document:\n" + doc + "\n\nQuestion: what does Mrs. Bennet tell her husband "
             "about Netherfield Park, and how does he answer? Quote the sentences."}]


def chat_prompt() -> list[dict]:
    return [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]


WORKLOADS = {"code": code_prompt, "document": document_prompt, "chat": chat_prompt}
SPEC_BATCH_TOKENS = 8  # the server's default max_batch_tokens: at batch 1, drafts of at most 7
METHODS = {"off": False, "ngram": {"method": "ngram", "num_speculative_tokens": 5},
           "suffix": {"method": "suffix", "num_speculative_tokens": 8}}


def post_json(port: int, path: str, body: dict, timeout: float = 60) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"{path}: HTTP {r.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def stream(port: int, messages: list, max_tokens: int, spec, temp: float = 0.0, seed: int = 0, salt: str | None = None,
           timeout: float = 600) -> dict:
    """One streaming chat completion: token count, first/last chunk times, text."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temp, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}, "speculative": spec}
    if salt:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    res = {"first": None, "last": None, "text": "", "tokens": 0}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        parts = []
        for ev in sse_events(r):
            if ev is None:
                break
            if "error" in ev:
                raise RuntimeError(f"stream error {ev['error']}")
            for ch in ev.get("choices") or []:
                c = (ch.get("delta") or {}).get("content")
                if c:
                    now = time.perf_counter() - t0
                    res["first"] = now if res["first"] is None else res["first"]
                    res["last"] = now
                    parts.append(c)
            if ev.get("usage"):
                res["tokens"] = ev["usage"]["completion_tokens"]
        res["text"] = "".join(parts)
        res["e2e"] = time.perf_counter() - t0
    finally:
        conn.close()
    return res


def decode_tok_s(r: dict) -> float | None:
    if r["first"] is None or r["last"] is None or r["last"] <= r["first"] or r["tokens"] < 8:
        return None
    return (r["tokens"] - 1) / (r["last"] - r["first"])


def spec_counters(port: int) -> tuple[float, float]:
    m = scrape_metrics(port)
    return m.get("kvserve:spec_decode_num_draft_tokens_total", 0.0), m.get("kvserve:spec_decode_num_accepted_tokens_total", 0.0)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def copy_oracle(prompt: list[int], output: list[int], k_max: int) -> dict:
    """The best any drafter that copies from the text can do on this output: at each step it
    drafts exactly the longest run (<= k_max tokens) of the coming output that occurs somewhere
    in the prompt + output so far, so nothing it drafts is rejected. Verification steps and
    draft tokens, deterministic: an upper bound for ngram and suffix drafts (without tree
    verification), against which their own step counts compare."""
    grams = [set() for _ in range(k_max + 1)]  # grams[l]: every l-token run of the context
    ctx: list[int] = []

    def push(tok: int) -> None:
        ctx.append(tok)
        for l in range(1, min(k_max, len(ctx)) + 1):
            grams[l].add(tuple(ctx[-l:]))

    for t in prompt:
        push(t)
    i, steps, drafted = 0, 0, 0
    # The first token is never drafted (as in the engine).
    if output:
        push(output[0])
        i, steps = 1, 1
    while i < len(output):
        l = 0
        while l < k_max and i + l + 1 <= len(output) and tuple(output[i:i + l + 1]) in grams[l + 1]:
            l += 1
        l = min(l, len(output) - i - 1)
        for t in output[i:i + l + 1]:
            push(t)
        drafted += l
        steps += 1
        i += l + 1
    return {"tokens": len(output), "steps": steps, "draft_tokens": drafted,
            "tokens_per_step": len(output) / steps if steps else None}


# ---- the peer ------------------------------------------------------------------------------

def render_prompt(port: int, messages: list) -> str:
    toks = post_json(port, "/tokenize", {"messages": messages, "add_generation_prompt": True})["tokens"]
    # llama.cpp adds the model's BOS itself: a rendered "<bos>" as well made Gemma 3's prompt
    # start with two (llama.cpp warns) and changed its answer.
    bos = post_json(port, "/tokenize", {"content": "", "add_special_tokens": True})["tokens"]
    if bos and toks[:len(bos)] == bos:
        toks = toks[len(bos):]
    return post_json(port, "/detokenize", {"tokens": toks})["prompt"]


def run_peer(binary: Path, model: Path, prompt: str, n: int, threads: int, extra: list[str]) -> dict | None:
    if not binary.exists():
        return None
    cmd = [str(binary), "-m", str(model), "-p", prompt, "-n", str(n), "-t", str(threads), "--temp", "0", "-c", "4096"] + extra
    if binary.name == "llama-completion":
        cmd += ["-no-cnv", "--no-warmup"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    res: dict = {"rc": p.returncode}
    m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([0-9.]+)\s+seconds, speed:\s+([0-9.]+) t/s", out)
    if m:  # llama-lookup
        res["tokens"], res["tok_s"] = int(m.group(1)), float(m.group(3))
    m = re.search(r"eval time =\s+([0-9.]+) ms /\s+(\d+) runs\s+\(\s*[0-9.]+ ms per token,\s+([0-9.]+) tokens per second\)", out)
    if m and "tok_s" not in res:  # llama-completion: the decode part of llama_perf_context_print
        res["tokens"], res["tok_s"] = int(m.group(2)), float(m.group(3))
    m = re.search(r"n_drafted\s*=\s*(\d+)", out)
    m2 = re.search(r"n_accept\s*=\s*(\d+)", out)
    if m and m2:
        res["drafted"], res["accepted"] = int(m.group(1)), int(m2.group(1))
    if "tok_s" not in res:
        res["error"] = out[-600:]
    return res


# ---- 16 users ------------------------------------------------------------------------------

def users_run(port: int, users: int, seconds: float, spec, prompts: list[list], max_tokens: int) -> dict:
    stop_at = time.time() + seconds
    lock = threading.Lock()
    done = {"requests": 0, "tokens": 0, "errors": 0}

    def user(u: int):
        k = 0
        while time.time() < stop_at:
            try:
                r = stream(port, prompts[(u + k) % len(prompts)], max_tokens, spec, temp=0.7, seed=1000 * u + k)
                with lock:
                    done["requests"] += 1
                    done["tokens"] += r["tokens"]
            except Exception as e:  # noqa: BLE001
                with lock:
                    done["errors"] += 1
                log(f"user {u}: {e}")
            k += 1

    m0 = scrape_metrics(port)
    t0 = time.time()
    ths = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.time() - t0
    m1 = scrape_metrics(port)
    gen = m1.get("kvserve:generation_tokens_total", 0) - m0.get("kvserve:generation_tokens_total", 0)
    d = m1.get("kvserve:spec_decode_num_draft_tokens_total", 0) - m0.get("kvserve:spec_decode_num_draft_tokens_total", 0)
    a = m1.get("kvserve:spec_decode_num_accepted_tokens_total", 0) - m0.get("kvserve:spec_decode_num_accepted_tokens_total", 0)
    return {"tok_s": gen / wall, "wall_s": wall, "draft_tokens": d, "accepted_tokens": a, **done}


# ---- plot ----------------------------------------------------------------------------------

def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    wls = list(WORKLOADS)
    series = [("kvserve, no speculation", "off"), ("kvserve ngram", "ngram"), ("kvserve suffix", "suffix")]
    peer = [("llama.cpp plain", "peer_plain"), ("llama.cpp lookup", "peer_lookup")]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    names = series + [p for p in peer if any(res["batch1"][w].get(p[1]) for w in wls)]
    width = 0.8 / len(names)
    for i, (label, key) in enumerate(names):
        vals = [(res["batch1"][w].get(key) or {}).get("tok_s") or 0 for w in wls]
        bars = ax.bar([j + i * width for j in range(len(wls))], vals, width, label=label)
        for b, v in zip(bars, vals):
            if v:
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(wls))], wls)
    ax.set_ylabel("decode tok/s, batch 1 (median)")
    ax.set_title(f"Speculative decoding at batch 1 — {res['model']}, {res['host']['cpu']}", fontsize=10)
    ax.legend(fontsize=8)
    u = res.get("users") or {}
    if u:
        vals = [u["off"]["tok_s"], u["on"]["tok_s"]]
        ax2.bar(["off", "ngram (default)"], vals, color=["#999", "#2a7"])
        for j, v in enumerate(vals):
            ax2.text(j, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax2.set_title(f"{u['users']} users, temperature 0.7")
        ax2.set_ylabel("aggregate tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=str(ROOT / "build" / "kvserve"))
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--users-seconds", type=float, default=40)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--chat-template", default=None,
                    help="the server's --chat-template (default: gemma3 for a Gemma 3 GGUF, which carries none)")
    ap.add_argument("--kvserve-arg", action="append", default=[],
                    help="extra kvserve serve argument (repeatable), e.g. --kvserve-arg=--act-quant --kvserve-arg=q8")
    ap.add_argument("--out", default=str(OUT / "spec_bench.json"))
    args = ap.parse_args()
    if args.chat_template is None and "gemma-3" in Path(args.model).name.lower():
        args.chat_template = "gemma3"
    OUT.mkdir(parents=True, exist_ok=True)
    port = free_port()
    srv = Server("kvserve", [args.kvserve, "serve", "-m", args.model, "--port", str(port), "-t", str(args.threads),
                             "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 5})]
                 + (["--chat-template", args.chat_template] if args.chat_template else []) + args.kvserve_arg,
                 port, OUT / "spec_bench_logs" / "kvserve.log")
    srv.start(timeout=120)
    res: dict = {"host": {"cpu": platform.processor() or "", "cores": os.cpu_count()}, "model": Path(args.model).name,
                 "chat_template": args.chat_template, "kvserve_args": args.kvserve_arg,
                 "threads": args.threads, "repeats": args.repeats, "max_tokens": args.max_tokens, "batch1": {}}
    try:
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
        res["host"]["cpu"] = cpu
    except OSError:
        pass
    try:
        for wl, make in WORKLOADS.items():
            msgs = make()
            row: dict = {}
            texts = {}
            # warm-up: the prompt's pages into the prefix cache (TTFT is not what is measured here)
            stream(srv.port, msgs, 8, False)
            # Methods interleaved within each repeat, so a drift of the host's speed hits all alike.
            runs = {m: [] for m in METHODS}
            acc = {m: [0.0, 0.0] for m in METHODS}
            for rep in range(args.repeats):
                for method, spec in METHODS.items():
                    salt = f"spec-{wl}-{method}-{rep}" if method == "suffix" else None
                    d0, a0 = spec_counters(srv.port)
                    r = stream(srv.port, msgs, args.max_tokens, spec, salt=salt)
                    d1, a1 = spec_counters(srv.port)
                    acc[method][0] += d1 - d0
                    acc[method][1] += a1 - a0
                    runs[method].append(decode_tok_s(r))
                    texts.setdefault(method, r["text"])
                    log(f"{wl:8s} {method:6s} repeat {rep + 1}/{args.repeats}: {r['tokens']} tokens, "
                        f"{(runs[method][-1] or 0):.1f} tok/s")
            for method in METHODS:
                d, a = acc[method]
                n_tok = r["tokens"] * args.repeats
                steps = n_tok - a  # a step emits its accepted drafts and one token
                row[method] = {"tok_s": med(runs[method]), "runs": runs[method], "tokens": r["tokens"],
                               "acceptance": a / d if d > 0 else None, "draft_tokens": d / args.repeats,
                               "steps": steps / args.repeats, "tokens_per_step": n_tok / steps if steps else None}
            # What a verified draft token costs, as a fraction of a decode step, from the timings:
            # time = steps * t_step + drafts * t_row (t_step from the run without drafts). Noisy.
            t_step = 1.0 / row["off"]["tok_s"] if row["off"]["tok_s"] else None
            for method in ("ngram", "suffix"):
                m = row[method]
                if t_step and m["tok_s"] and m["draft_tokens"]:
                    t_row = (m["tokens"] / m["tok_s"] - m["steps"] * t_step) / m["draft_tokens"]
                    m["draft_token_cost"] = t_row / t_step
            k_cap = min(SPEC_BATCH_TOKENS - 1, max(c["num_speculative_tokens"] for c in METHODS.values() if c))
            prompt_ids = post_json(srv.port, "/tokenize", {"messages": msgs, "add_generation_prompt": True})["tokens"]
            out_ids = post_json(srv.port, "/tokenize", {"content": texts["off"], "add_special_tokens": False})["tokens"]
            row["copy_oracle"] = copy_oracle(prompt_ids, out_ids, k_cap)
            row["copy_oracle"]["k_max"] = k_cap
            for method in ("ngram", "suffix"):
                if row["off"]["tok_s"] and row[method]["tok_s"]:
                    row[method]["speedup"] = row[method]["tok_s"] / row["off"]["tok_s"]
                row[method]["same_text_as_off"] = texts[method] == texts["off"]  # greedy: must hold
            if not args.no_peer:
                prompt = render_prompt(srv.port, msgs)
                plain = [run_peer(PEER_BIN / "llama-completion", Path(args.model), prompt, args.max_tokens, args.threads, [])
                         for _ in range(args.repeats)]
                look = [run_peer(PEER_BIN / "llama-lookup", Path(args.model), prompt, args.max_tokens, args.threads,
                                 ["--spec-draft-n-max", "5"]) for _ in range(args.repeats)]
                if plain[0]:
                    row["peer_plain"] = {"tok_s": med([p.get("tok_s") for p in plain]), "runs": plain}
                if look[0]:
                    row["peer_lookup"] = {"tok_s": med([p.get("tok_s") for p in look]), "runs": look}
                    if row.get("peer_plain", {}).get("tok_s") and row["peer_lookup"]["tok_s"]:
                        row["peer_lookup"]["speedup"] = row["peer_lookup"]["tok_s"] / row["peer_plain"]["tok_s"]
                best = max((row[m]["tok_s"] or 0) for m in ("ngram", "suffix"))
                peer_best = max((row.get(k, {}).get("tok_s") or 0) for k in ("peer_plain", "peer_lookup"))
                if peer_best:
                    row["ratio_vs_peer_faster_mode"] = best / peer_best
                log(f"{wl}: peer plain {row.get('peer_plain', {}).get('tok_s')}, lookup {row.get('peer_lookup', {}).get('tok_s')}")
            res["batch1"][wl] = row
            log(f"{wl}: off {row['off']['tok_s']:.1f}, ngram {row['ngram']['tok_s']:.1f} "
                f"(x{row['ngram'].get('speedup', 0):.2f}, acc {row['ngram']['acceptance'] or 0:.2f}, "
                f"{row['ngram']['tokens_per_step']:.2f} tok/step), "
                f"suffix {row['suffix']['tok_s']:.1f} (x{row['suffix'].get('speedup', 0):.2f}, "
                f"acc {row['suffix']['acceptance'] or 0:.2f}, {row['suffix']['tokens_per_step']:.2f} tok/step); "
                f"copy oracle {row['copy_oracle']['tokens_per_step']:.2f} tok/step; draft token cost "
                + ", ".join(f"{m} {row[m]['draft_token_cost']:.2f}" for m in ("ngram", "suffix") if "draft_token_cost" in row[m]))
        if args.users > 0:
            prompts = [make() for make in WORKLOADS.values()]
            u = {"users": args.users, "seconds": args.users_seconds}
            for name, spec in (("off", False), ("on", None)):
                body_spec = spec if spec is not None else True  # true: the server's configuration
                log(f"{args.users} users, speculation {name}, {args.users_seconds:.0f} s")
                u[name] = users_run(srv.port, args.users, args.users_seconds, body_spec, prompts, 128)
                log(f"  {u[name]['tok_s']:.1f} tok/s aggregate, {u[name]['requests']} requests, "
                    f"{u[name]['draft_tokens']:.0f} draft tokens")
            u["ratio_on_off"] = u["on"]["tok_s"] / u["off"]["tok_s"]
            res["users"] = u
    finally:
        srv.stop()
    Path(args.out).write_text(json.dumps(res, indent=2))
    log(f"wrote {args.out}")
    png = Path(args.out).with_suffix(".png")
    if plot(res, png):
        if Path(args.out).resolve() == (OUT / "spec_bench.json").resolve():  # the documented run only
            shutil.copy(png, ROOT / "docs" / "spec_bench.png")
            log(f"wrote {png} and docs/spec_bench.png")
        else:
            log(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
