#!/usr/bin/env python3
"""Generate the golden files the C++ engine's tests compare against.

Re-run (from the repo root; needs numpy, gguf, tokenizers, jinja2; no network, ~2 minutes
on 2 cores):

    python tests/reference/make_golden.py \
        [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--out tests/data/golden] \
        [--dist-positions 2]

It writes, into --out (format described in tests/data/golden/README.md):
    golden.json       index: model fingerprint, config, and per prompt: text, token ids,
                      per-position top-1 / top-5 ids and log-probs (teacher-forced),
                      mean NLL, a 32-token greedy continuation, and which rows of
                      golden_dist.f16 belong to it
    golden_dist.f16   raw little-endian float16 [n_rows][vocab]: full log-softmax of the
                      oracle at sampled positions (always the last prompt position, plus
                      --dist-positions - 1 more spread over the prompt)

Everything comes from tests/reference/llama_ref.py (float64 numpy oracle) and token ids
from tests/reference/tokenizer_ref.py (HF `tokenizers` built from the GGUF vocab/merges,
digits split one by one as llama.cpp's "smollm" pre-tokenizer does).

Size: each full row is vocab * 2 bytes (96 KiB here). The default (2 rows per prompt of
>= 32 tokens, 1 otherwise) keeps the directory under ~2 MB; --dist-positions 16 gives the
full 16-positions-per-prompt set (~15 MB), too big to commit. The per-position float32
logits of whole prompts (>= 3 MB per 16-token prompt even compressed) are not stored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import llama_ref  # noqa: E402
from tokenizer_ref import encode, load_tokenizer  # noqa: E402

REPO = HERE.parent.parent
N_GREEDY = 32
TOP_K = 5

# ------------------------------------------------------------------ prompts
# (name, kind, text or chat messages, target length). Text prompts are tokenized in full and
# the ids cut to `target` tokens (so `tokens` is a prefix of encode(text)); chat prompts are
# rendered with the GGUF's own chat template and kept whole (target None).

LONG_PROSE = """\
The village sat at the bend of a slow brown river, and for most of the year nothing much \
happened there. In spring the water rose and the fields along the bank turned soft and dark; \
in summer the children swam near the old mill and the farmers argued about the price of \
grain. The baker opened his shop before dawn, and by the time the church bell rang seven the \
smell of fresh bread had reached every street.

Everything changed the year the railway came. Surveyors arrived first, young men with long \
measuring chains and notebooks full of numbers, who slept at the inn and asked endless \
questions about floods. Then came the workers, hundreds of them, and with them came money, \
noise, and strangers. The baker hired two assistants. The inn added a second floor. A \
schoolteacher from the city opened a small library in the back room of the post office, and \
to everyone's surprise it was full every evening.

Not everyone welcomed the change. Old Martha, who had kept bees on the hill for forty years, \
said the smoke would drive the bees away and the honey would taste of coal. The miller worried \
that the trains would carry cheap flour from the big factories and ruin his trade. He was \
right about that, in the end, though it took almost ten years. The bees, however, stayed, and \
Martha's honey was sold in shops as far away as the capital.

When the first train finally crossed the new iron bridge, the whole village gathered on the \
bank to watch. The engine was painted green and gold, and it moved more slowly than anyone had \
expected, as if it, too, were unsure of the river. A boy ran alongside it until the end of the \
platform, waving his cap. Years later, as an old man, he would tell his grandchildren that he \
had raced the train that day and won, and nobody ever had the heart to correct him.

Today the mill is a museum and the railway carries more goods than passengers. The library \
has moved into a building of its own, with tall windows that look out over the water. On \
summer evenings people still walk down to the bridge to watch the light fade over the fields, \
and some of them say that if you listen carefully you can hear the bees on the hill, working \
late, as they always have.
"""

GETTYSBURG = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we \
are engaged in a great civil war, testing whether that nation, or any nation so conceived and \
so dedicated, can long endure. We are met on a great battle-field of that war. We have come to \
dedicate a portion of that field, as a final resting place for those who here gave their lives \
that that nation might live. It is altogether fitting and proper that we should do this.
"""

PY_CODE = '''\
def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1."""
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''

C_CODE = """\
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct node {
    int key;
    struct node *left;
    struct node *right;
} node_t;

static node_t *insert(node_t *root, int key) {
    if (root == NULL) {
        node_t *n = malloc(sizeof(*n));
        n->key = key;
        n->left = n->right = NULL;
        return n;
    }
    if (key < root->key)
        root->left = insert(root->left, key);
    else if (key > root->key)
        root->right = insert(root->right, key);
    return root;
}

static void print_inorder(const node_t *root) {
    if (root == NULL)
        return;
    print_inorder(root->left);
    printf("%d\\n", root->key);
    print_inorder(root->right);
}

int main(int argc, char **argv) {
    node_t *root = NULL;
    for (int i = 1; i < argc; i++)
        root = insert(root, atoi(argv[i]));
    print_inorder(root);
    return 0;
}
"""

CSV_NUMBERS = """\
date,city,temperature_c,rainfall_mm,visitors
2023-01-15,Oslo,-4.5,12.3,1520
2023-02-15,Oslo,-3.1,9.8,1675
2023-03-15,Oslo,1.2,14.0,2210
2023-04-15,Oslo,6.8,21.7,3045
2023-05-15,Oslo,12.4,30.1,4890
2023-06-15,Oslo,16.9,42.5,7312
2023-07-15,Oslo,18.3,55.0,8104
2023-08-15,Oslo,17.1,61.2,7650
2023-09-15,Oslo,12.6,48.9,5021
2023-10-15,Oslo,7.0,39.4,3380
2023-11-15,Oslo,2.3,25.6,2015
2023-12-15,Oslo,-1.8,18.2,1890
Total visitors: 49712. Average temperature: 7.1 degrees.
"""

PROMPTS = [
    ("prose_short", "text", "The old lighthouse keeper climbed the spiral stairs every evening "
                            "to light the great lamp at the top of the tower.", 16),
    ("numbers_primes", "text", "Here is the list of the first prime numbers: 2, 3, 5, 7, 11, 13, "
                               "17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73.", 40),
    ("chat_single", "chat", [{"role": "user", "content":
                              "What are three simple habits that help people sleep better?"}], None),
    ("code_python", "text", PY_CODE, 100),
    ("prose_gettysburg", "text", GETTYSBURG, 112),
    ("code_c", "text", C_CODE, 200),
    ("csv_numbers", "text", CSV_NUMBERS, 256),
    ("chat_multi_turn", "chat", [
        {"role": "system", "content": "You are a concise assistant who answers in plain English."},
        {"role": "user", "content": "I am planning a trip to Norway in the summer. What should I pack?"},
        {"role": "assistant", "content": "Pack layers: a light waterproof jacket, a warm fleece, "
                                         "comfortable walking shoes, and a hat. Summer days are long "
                                         "but evenings can be cool, especially in the mountains and "
                                         "near the fjords. Bring sunglasses and sunscreen too, since "
                                         "the sun stays up until late at night in June and July."},
        {"role": "user", "content": "Thanks! Which cities would you recommend for a first visit, "
                                    "and how many days should I spend in each one?"},
    ], None),
    ("prose_long_400", "text", LONG_PROSE, 400),
    ("prose_long_512", "text", LONG_PROSE + "\n" + GETTYSBURG, 512),
]


def render_chat(template: str, messages) -> str:
    import jinja2
    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def dist_positions(T: int, n: int) -> list[int]:
    """n positions spread over [0, T-1], always including T-1; fewer if T is short."""
    if T < 32:
        n = 1
    if n <= 1:
        return [T - 1]
    # skip the very first positions (tiny context) and always end on the last one
    pos = np.linspace(T / 2 if n == 2 else 1, T - 1, n).round().astype(int)
    return sorted(set(int(p) for p in pos))


def r5(x):
    return [round(float(v), 5) for v in x]


def main(argv=None):
    ap = argparse.ArgumentParser(description="write tests/data/golden/*")
    ap.add_argument("--model", default=str(REPO / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default=str(REPO / "tests/data/golden"))
    ap.add_argument("--dist-positions", type=int, default=2,
                    help="full log-softmax rows per prompt (>= 1, <= 16; the last position is "
                         "always one of them)")
    args = ap.parse_args(argv)
    n_dist = max(1, min(16, args.dist_positions))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    print(f"loading {args.model} ...", flush=True)
    model = llama_ref.load_model(args.model)
    cfg = model.cfg
    tok = load_tokenizer(args.model)
    import gguf
    template = gguf.GGUFReader(args.model).fields["tokenizer.chat_template"].contents()
    print(f"  loaded in {time.time() - t_start:.1f}s; {cfg}", flush=True)

    prompts_json, dist_rows, dist_index = [], [], []
    for pi, (name, kind, src, target) in enumerate(PROMPTS):
        t0 = time.time()
        text = render_chat(template, src) if kind == "chat" else src
        full = encode(tok, text)
        tokens = full if target is None else full[:target]
        if target is not None and len(full) < target:
            raise SystemExit(f"prompt {name}: text has only {len(full)} tokens < {target}")
        T = len(tokens)

        tf_logits, cont, cont_logits = llama_ref.forward_and_greedy(model, tokens, N_GREEDY)
        lp = llama_ref.log_softmax(tf_logits)                   # [T, vocab] float64
        top = np.argsort(-lp, axis=1, kind="stable")[:, :TOP_K]
        top_lp = np.take_along_axis(lp, top, axis=1)
        nll = -lp[np.arange(T - 1), np.asarray(tokens[1:])]

        glp = llama_ref.log_softmax(cont_logits)
        gsorted = -np.sort(-cont_logits, axis=1)
        greedy_margin = gsorted[:, 0] - gsorted[:, 1]
        greedy_lp = glp[np.arange(len(cont)), cont]

        rows = []
        for p in dist_positions(T, n_dist):
            rows.append(len(dist_rows))
            dist_rows.append(lp[p].astype("<f2"))
            dist_index.append({"prompt": pi, "name": name, "position": p})

        prompts_json.append({
            "name": name,
            "kind": kind,
            "text": text,
            "tokens_are_prefix_of_encode_text": target is not None,
            "n_tokens": T,
            "tokens": [int(t) for t in tokens],
            "top1": [int(t) for t in top[:, 0]],
            "top5_ids": [[int(t) for t in r] for r in top],
            "top5_logprobs": [r5(r) for r in top_lp],
            "mean_nll": float(nll.mean()) if T > 1 else None,
            "perplexity": float(np.exp(nll.mean())) if T > 1 else None,
            "greedy": [int(t) for t in cont],
            "greedy_logprobs": r5(greedy_lp),
            "greedy_top2_margin": r5(greedy_margin),
            "greedy_text": tok.decode(cont, skip_special_tokens=False),
            "dist_rows": rows,
        })
        print(f"[{pi + 1:2d}/{len(PROMPTS)}] {name:18s} T={T:3d} ppl={np.exp(nll.mean()):7.2f} "
              f"min greedy margin={greedy_margin.min():.3f} ({time.time() - t0:.1f}s) "
              f"-> {tok.decode(cont, skip_special_tokens=False)[:60]!r}", flush=True)

    dist = np.stack(dist_rows).astype("<f2")
    dist_path = out / "golden_dist.f16"
    dist.tofile(dist_path)

    index = {
        "format_version": 1,
        "generator": "tests/reference/make_golden.py",
        "model": {
            "file": Path(args.model).name,
            "sha256": sha256_file(args.model),
            "arch": cfg.arch,
            "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
            "n_head_kv": cfg.n_head_kv, "head_dim": cfg.head_dim, "n_ff": cfg.n_ff,
            "n_rot": cfg.n_rot, "rope_base": cfg.rope_base, "rope_style": cfg.rope_style,
            "rms_eps": cfg.rms_eps, "vocab": cfg.vocab,
        },
        "oracle": "numpy float64, weights dequantized by gguf.quants.dequantize",
        "tokenizer": "tests/reference/tokenizer_ref.py (tokenizers BPE from GGUF vocab/merges, "
                     "Digits(individual) + ByteLevel pre-tokenizer, control tokens matched "
                     "whole, no BOS)",
        "top_k": TOP_K,
        "n_greedy": N_GREEDY,
        "logprob_rounding": 5,
        "dist": {
            "file": dist_path.name,
            "dtype": "float16",
            "endianness": "little",
            "shape": [int(dist.shape[0]), int(dist.shape[1])],
            "content": "log_softmax of the logits at (prompt, position): the distribution of "
                       "the token following tokens[0..position]",
            "rows": dist_index,
        },
        "prompts": prompts_json,
    }
    json_path = out / "golden.json"
    with open(json_path, "w") as f:
        json.dump(index, f, separators=(",", ":"), ensure_ascii=False)
        f.write("\n")

    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {json_path} ({json_path.stat().st_size / 1e3:.0f} kB), {dist_path} "
          f"({dist.shape[0]} rows, {dist_path.stat().st_size / 1e3:.0f} kB); "
          f"directory total {total / 1e6:.2f} MB; {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
