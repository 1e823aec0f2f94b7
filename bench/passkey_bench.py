#!/usr/bin/env python3
"""Passkey retrieval through the server under each long-context KV policy.

A five-digit pass key is hidden at 10 depths in filler text of 2k, 4k and 8k tokens; the
request asks for it at the end (greedy, 8 tokens, /v1/completions through the `openai`
client); a retrieval counts when the key appears in the answer. Two orders, because SnapKV
chooses what to keep by the attention of the prompt's last queries (DESIGN.md: judge policies
with the question both inside and after the compressed context):

  after   the document, then "What is the pass key? The pass key is"   (the question is in
          SnapKV's observation window)
  before  "There is a pass key in the text below. Remember it." + document + "The pass key is"

Prompts stay in the prefix cache (8 GiB of KV) between policies, so only the first pass
prefills them all. Every policy gets its budget (a fraction of each prompt's length, per request through the
`kv_eviction` request field) on one server; Quest reads that fraction of pages (needs a
server started with --kv-sparse quest, which this script does). The full cache is the
baseline on the same server.

  python3 bench/passkey_bench.py                      # SmolLM2, budgets 25%, all policies
  python3 bench/passkey_bench.py --lengths 2048 --fractions 0.125 0.25

Output: bench/out/passkey_<model stem>.json, a markdown table on stdout, docs/passkey.png.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import Server, free_port, log  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
POLICIES = ["full", "window", "sinks", "h2o", "snapkv", "quest"]


def build_prompt(tok, n_tokens: int, depth: float, key: int, order: str) -> str:
    """Filler around the key sentence at `depth` (0 = start, 1 = end) so the prompt has about
    n_tokens tokens (tok counts tokens with the server: usage.prompt_tokens)."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    head = "There is a pass key hidden in the text below. Remember it.\n" if order == "before" else ""
    tail = "\nWhat is the pass key? The pass key is" if order == "after" else "\nThe pass key is"
    per = tok(FILLER)
    n_rep = max(1, (n_tokens - tok(head + needle + tail)) // per)
    k = int(round(depth * n_rep))
    return head + FILLER * k + needle + FILLER * (n_rep - k) + tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", type=Path, default=ROOT / "build" / "kvserve")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--depths", type=int, default=10)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25])
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--orders", nargs="+", default=["after", "before"])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "passkey.png")
    args = ap.parse_args()
    out = args.out or ROOT / "bench" / "out" / f"passkey_{args.model.stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    from openai import OpenAI

    port = free_port()
    srv = Server("kvserve", [str(args.kvserve), "serve", "-m", str(args.model), "--port", str(port),
                             "--kv-sparse", "quest", "--kv-sparse-pages", "1", "--kv-cache-memory", "8GiB",
                             "--max-model-len", str(max(args.lengths) + 256),
                             # 8k prompts plus the question pass SmolLM2's 8,192 trained positions a little
                             "--past-trained-context"],
                 port, ROOT / "bench" / "out" / "passkey_server.log")
    srv.start(120)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
    # token counts from the server itself (usage.prompt_tokens of a 1-token request)
    cache: dict[str, int] = {}

    def ntok(text: str) -> int:
        if text not in cache:
            r = client.completions.create(model=srv.model_id, prompt=text, max_tokens=1, temperature=0)
            cache[text] = r.usage.prompt_tokens
        return cache[text]

    rng = random.Random(args.seed)
    records = []
    cases = [(L, d, o) for L in args.lengths for d in range(args.depths) for o in args.orders]
    configs = [("full", 1.0)] + [(p, f) for p in args.policies if p != "full" for f in args.fractions]
    t0 = time.time()
    try:
        keys = {c: rng.randrange(10000, 99999) for c in cases}
        prompts = {c: build_prompt(ntok, c[0], c[1] / max(1, args.depths - 1), keys[c], c[2]) for c in cases}
        n_total, done = len(cases) * len(configs), 0
        for policy, frac in configs:
            hits = 0
            for c in cases:
                L, d, order = c
                extra = {"kv_eviction": {"policy": "none"}}  # the server's default is Quest (key bounds kept)
                if policy == "quest":
                    extra = {"kv_eviction": {"sparse": "quest", "sparse_pages": max(1, int(L * frac) // 16)}}
                elif policy != "full":
                    extra = {"kv_eviction": {"policy": policy, "budget": int(L * frac)}}
                r = client.completions.create(model=srv.model_id, prompt=prompts[c], max_tokens=8, temperature=0,
                                              extra_body=extra)
                ok = str(keys[c]) in r.choices[0].text
                hits += ok
                done += 1
                ev = getattr(r.usage, "model_extra", None) or {}
                records.append({"policy": policy, "fraction": frac, "length": L, "depth": d, "order": order, "key": keys[c],
                                "answer": r.choices[0].text, "ok": ok, "prompt_tokens": r.usage.prompt_tokens,
                                "kv_eviction": ev.get("kv_eviction")})
            el = time.time() - t0
            log(f"{policy} {frac:.1%}: {hits}/{len(cases)} retrieved ({done}/{n_total} requests, {el / 60:.1f} min, "
                f"ETA {el / done * (n_total - done) / 60:.1f} min)")
            out.write_text(json.dumps(records, indent=1))
    finally:
        srv.stop()

    # table: accuracy per policy/fraction, per length and order
    print("| policy | budget | " + " | ".join(f"{L} {o}" for L in args.lengths for o in args.orders) + " | all |")
    print("|---|---|" + "---|" * (len(args.lengths) * len(args.orders) + 1))
    for policy, frac in configs:
        rs = [r for r in records if r["policy"] == policy and r["fraction"] == frac]
        cells = []
        for L in args.lengths:
            for o in args.orders:
                sub = [r for r in rs if r["length"] == L and r["order"] == o]
                cells.append(f"{100 * sum(r['ok'] for r in sub) / max(1, len(sub)):.0f}%")
        allp = 100 * sum(r["ok"] for r in rs) / max(1, len(rs))
        print(f"| {policy} | {'100%' if policy == 'full' else f'{frac:.1%}'} | " + " | ".join(cells) + f" | {allp:.0f}% |")
    log(f"wrote {out}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(args.orders), figsize=(5.5 * len(args.orders), 3.6), squeeze=False)
    for ax, o in zip(axes[0], args.orders):
        labels = [f"{p}" + ("" if p == "full" else f" {f:.0%}") for p, f in configs]
        for i, L in enumerate(args.lengths):
            acc = []
            for p, f in configs:
                sub = [r for r in records if r["policy"] == p and r["fraction"] == f and r["length"] == L and r["order"] == o]
                acc.append(100 * sum(r["ok"] for r in sub) / max(1, len(sub)))
            w = 0.8 / len(args.lengths)
            ax.bar([x + i * w for x in range(len(configs))], acc, width=w, label=f"{L} tokens")
        ax.set_xticks([x + 0.4 - 0.4 / len(args.lengths) for x in range(len(configs))], labels, rotation=30, fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_ylabel("pass key retrieved (%)")
        ax.set_title(f"question {o} the document", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{args.model.stem}: passkey retrieval at 10 depths per KV policy", fontsize=10)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    log(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
