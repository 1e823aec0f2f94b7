#!/usr/bin/env python3
"""Cross-check the numpy oracles (gemma3_ref.py, mla_ref.py) against llama.cpp, a second
implementation, on the same GGUF and the same token ids. Run by hand (not part of make test):

    python tests/reference/compare_llamacpp.py gemma3 [--model models/gemma-3-270m-Q4_K_M.gguf]
    python tests/reference/compare_llamacpp.py mla

Needs the peer build (bench/peer/build_llama.sh: static libllama/libggml in
bench/peer/work/build-<ver>); tests/reference/llamacpp_dump.cpp is compiled against it into
--build-dir (default /tmp/kvserve-llamacpp-dump). llama.cpp runs with an F32 KV cache, flash
attention off, one batch per prompt, 2 threads.

Reports, per prompt: token ids equal (gemma3: llama_tokenize vs spm_tokenizer_ref), top-1
agreement and KL(oracle || llama.cpp) at the compared positions, and the greedy
continuations (32 tokens) side by side. gemma3 also: KL with the sliding window removed from
the oracle on the 700-token prompt (positions >= 512), a window-boundary probe (llama.cpp with
gemma3.attention.sliding_window overridden to 8 vs the oracle with windows 7 / 8 / 9), and
ablations of each semantic choice (norm +1, embedding scale, local RoPE base, global layer
placement, query scale, GELU form). mla: the four layouts (split / legacy attn_kv_b, with and
without q LoRA) of the generated test model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
REPO = HERE.parent.parent
from llama_ref import log_softmax  # noqa: E402

PEER = REPO / "bench/peer/work"


def build_dumper(build_dir: Path) -> Path:
    src = HERE / "llamacpp_dump.cpp"
    exe = build_dir / "llamacpp_dump"
    if exe.exists() and exe.stat().st_mtime > src.stat().st_mtime:
        return exe
    builds = sorted(PEER.glob("build-*/src/libllama.a"))
    if not builds:
        raise SystemExit("no peer llama.cpp build: run bench/peer/build_llama.sh")
    b = builds[-1].parent.parent
    ver = b.name.split("-", 1)[1]
    s = PEER / f"src/llama_cpp_python-{ver}/vendor/llama.cpp"
    build_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["g++", "-O2", "-std=c++17", f"-I{s}/include", f"-I{s}/ggml/include", str(src), "-o",
           str(exe), f"{b}/src/libllama.a", f"{b}/ggml/src/libggml.a",
           f"{b}/ggml/src/libggml-cpu.a", f"{b}/ggml/src/libggml-base.a",
           "-ldl", "-lm", "-fopenmp", "-lpthread"]
    subprocess.run(cmd, check=True)
    return exe


class LlamaCpp:
    def __init__(self, exe: Path, model: Path, tmp: Path):
        self.exe, self.model, self.tmp = exe, model, tmp

    def tokenize(self, text: str) -> list[int]:
        f = self.tmp / "text.txt"
        f.write_bytes(text.encode("utf-8"))
        r = subprocess.run([str(self.exe), str(self.model), "tokenize", str(f)],
                           check=True, capture_output=True, text=True)
        return [int(x) for x in r.stdout.strip().split(",") if x]

    def logits(self, ids, positions, n_greedy=0, override=None):
        fi, fo = self.tmp / "ids.txt", self.tmp / "logits.f32"
        fi.write_text(",".join(map(str, ids)))
        env = dict(os.environ)
        if override:
            env["LLAMA_DUMP_OVERRIDE"] = override
        r = subprocess.run([str(self.exe), str(self.model), "logits", str(fi), str(fo),
                            ",".join(map(str, positions)), str(n_greedy)],
                           check=True, capture_output=True, text=True, env=env)
        greedy = []
        for line in r.stdout.splitlines():
            if line.startswith("greedy: "):
                greedy = [int(x) for x in line[8:].split(",") if x]
        lg = np.fromfile(fo, dtype=np.float32).reshape(len(positions), -1)
        return lg, greedy


def dequantized_copy(src: Path, dst: Path) -> Path:
    """Write src with every tensor dequantized (gguf.quants.dequantize) to F32, same metadata.
    llama.cpp then multiplies in F32 without quantizing activations: what remains between it
    and the oracle is float32 arithmetic and its fp16 GELU table."""
    import gguf
    from llama_ref import dequant_tensor
    if dst.exists():
        return dst
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[1] if len(f.types) > 1 else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in r.tensors:
        w.add_tensor(t.name, dequant_tensor(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def kl_rows(lp_oracle, logits_other):
    """KL(oracle || other) per row; lp_oracle: log-softmax rows (float64)."""
    lo = np.asarray(lp_oracle, np.float64)
    lq = log_softmax(logits_other)
    return (np.exp(lo) * (lo - lq)).sum(-1)


def greedy_report(g_oracle, g_llama, margins):
    n = next((i for i, (a, b) in enumerate(zip(g_oracle, g_llama)) if a != b), len(g_oracle))
    s = f"greedy equal for {n}/{len(g_oracle)}"
    if n < len(g_oracle):
        s += f" (diverges where the oracle's top-2 margin is {margins[n]:.3f}"
        s += ", llama.cpp took something else)"
    return n, s


def stats(kl, top_o, top_l):
    return {"n_positions": int(len(kl)), "top1_agree": float(np.mean(top_o == top_l)),
            "kl_mean": float(np.mean(kl)), "kl_max": float(np.max(kl))}


# ------------------------------------------------------------------ gemma3

def cmd_gemma3(args, exe, tmp):
    import gemma3_ref
    from golden_lib import run_prompt
    from make_golden_gemma3 import PROMPTS, gemma_chat
    from spm_tokenizer_ref import load_tokenizer
    model_path = Path(args.model)
    t0 = time.time()
    model = gemma3_ref.load_model(model_path)
    tok = load_tokenizer(model_path)
    lc_model = model_path
    if args.f32:
        lc_model = dequantized_copy(model_path, Path(args.build_dir) / (model_path.stem + ".f32.gguf"))
        print(f"llama.cpp runs on the dequantized F32 copy {lc_model}", flush=True)
    lc = LlamaCpp(exe, lc_model, tmp)
    print(f"loaded oracle in {time.time() - t0:.0f}s", flush=True)
    report = {"prompts": []}
    all_kl, all_agree = [], []
    for name, kind, src, target, _ in PROMPTS:
        if args.only and name not in args.only:
            continue
        text = gemma_chat(src) if kind == "chat" else src
        ids_py = tok.encode(text)
        ids_cpp = lc.tokenize(text)
        tok_equal = ids_py == ids_cpp
        ids = ids_py if target is None else ids_py[:target]
        T = len(ids)
        if T <= 128:
            positions = list(range(T))
        else:
            positions = sorted(set(range(0, T, 8)) | set(range(505, min(T, 521))) | {T - 1})
        lg, g_llama = lc.logits(ids, positions, 32)
        entry, rows = run_prompt(gemma3_ref, model, ids, set(positions))
        lp = np.stack([rows[p] for p in positions])
        kl = kl_rows(lp, lg)
        top_o = lp.argmax(-1)
        top_l = lg.argmax(-1)
        n_eq, gs = greedy_report(entry["greedy"], g_llama, entry["greedy_top2_margin"])
        st = stats(kl, top_o, top_l)
        rec = {"name": name, "n_tokens": T, "tokens_equal_llama_cpp": tok_equal, **st,
               "greedy_equal_prefix": n_eq}
        all_kl.append(kl)
        all_agree.append(top_o == top_l)
        print(f"{name:16s} T={T:3d} tokens equal: {tok_equal}  top-1 {st['top1_agree']:.3f} over "
              f"{len(positions)} positions  KL mean {st['kl_mean']:.2e} max {st['kl_max']:.2e}  "
              f"{gs}", flush=True)
        if T > 512:
            late = [i for i, p in enumerate(positions) if p >= 512]
            pl = [positions[i] for i in late]
            h = gemma3_ref.forward_hidden(model, ids, None, window_override=0)
            lp_nw = log_softmax(gemma3_ref.logits_from_hidden(model, h[pl]))
            kl_nw = kl_rows(lp_nw, lg[late])
            kl_w = kl[late]
            rec["window_check"] = {"positions": len(pl), "kl_mean_with_window": float(kl_w.mean()),
                                   "kl_mean_without_window": float(kl_nw.mean()),
                                   "kl_oracle_window_vs_no_window": float(kl_rows(lp[late], np.stack(
                                       [lp_nw[i] for i in range(len(pl))])).mean())}
            print(f"    positions >= 512: KL(oracle with window || llama.cpp) {kl_w.mean():.2e}, "
                  f"KL(oracle without window || llama.cpp) {kl_nw.mean():.2e}", flush=True)
        report["prompts"].append(rec)
    kl = np.concatenate(all_kl)
    ag = np.concatenate(all_agree)
    report["overall"] = {"positions": int(len(kl)), "top1_agree": float(ag.mean()),
                         "kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)),
                         "kl_max": float(kl.max())}
    print(f"overall: {len(kl)} positions, top-1 agreement {ag.mean():.4f}, KL mean {kl.mean():.2e} "
          f"median {np.median(kl):.2e} max {kl.max():.2e}", flush=True)

    if args.no_extras:
        return report
    # window boundary probe on a short prompt: llama.cpp window 8
    long_text = [p for p in PROMPTS if p[0] == "long_700_window"][0][2]
    ids = tok.encode(long_text)[:48]
    W = 8
    lg, _ = lc.logits(ids, list(range(len(ids))), 0,
                      override=f"gemma3.attention.sliding_window=int:{W}")
    probe = {}
    for w in (W - 1, W, W + 1):
        h = gemma3_ref.forward_hidden(model, ids, None, window_override=w)
        kl = kl_rows(log_softmax(gemma3_ref.logits_from_hidden(model, h)), lg)
        probe[w] = float(kl[W:].mean())
    report["window_probe"] = {"llama_cpp_window": W, "kl_mean_by_oracle_window": probe}
    print(f"window probe (llama.cpp n_swa={W}, 48 tokens, positions >= {W}): " +
          ", ".join(f"oracle window {w}: KL {v:.2e}" for w, v in probe.items()), flush=True)

    # ablations on prose_short + chat_single
    ab_ids = [tok.encode(PROMPTS[0][2]), tok.encode(gemma_chat(PROMPTS[2][2]))]
    ab_llama = [lc.logits(i, list(range(len(i))))[0] for i in ab_ids]

    def kl_of(m):
        ks = []
        for i, lg in zip(ab_ids, ab_llama):
            h = gemma3_ref.forward_hidden(m, i)
            ks.append(kl_rows(log_softmax(gemma3_ref.logits_from_hidden(m, h)), lg))
        return float(np.concatenate(ks).mean())

    cfg = model.cfg
    norms = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm")
    variants = {
        "as decided": model,
        "norm weights + 1": dataclasses.replace(
            model, output_norm=model.output_norm + 1,
            layers=[dataclasses.replace(L, **{n: getattr(L, n) + 1 for n in norms})
                    for L in model.layers]),
        "embedding scale bf16(sqrt(640)) = 25.25": dataclasses.replace(
            model, cfg=dataclasses.replace(cfg, embd_scale=25.25)),
        "no embedding scale": dataclasses.replace(model, cfg=dataclasses.replace(cfg, embd_scale=1.0)),
        "local rope base 1e6 (= global)": dataclasses.replace(
            model, cfg=dataclasses.replace(cfg, rope_base_swa=cfg.rope_base)),
        "global layers 0,6,12 (il % 6 == 0)": dataclasses.replace(
            model, cfg=dataclasses.replace(cfg, swa_layers=[il % 6 != 0 for il in range(cfg.n_layer)])),
        "rope style norm": None,
        "query scale 1/sqrt(n_embd/n_head)": dataclasses.replace(
            model, cfg=dataclasses.replace(cfg, attn_scale=1 / np.sqrt(cfg.n_embd / cfg.n_head))),
        "GELU erf (exact) instead of tanh": "gelu_erf",
    }
    report["ablations"] = {}
    for name, m in variants.items():
        if m is None:
            orig = gemma3_ref.rope
            gemma3_ref.rope = lambda x, p, n, b, s: orig(x, p, n, b, "norm")
            k = kl_of(model)
            gemma3_ref.rope = orig
        elif isinstance(m, str):
            from math import erf
            orig = gemma3_ref.gelu_tanh
            verf = np.vectorize(erf)
            gemma3_ref.gelu_tanh = lambda x: 0.5 * x * (1 + verf(x / np.sqrt(2)))
            k = kl_of(model)
            gemma3_ref.gelu_tanh = orig
        else:
            k = kl_of(m)
        report["ablations"][name] = k
        print(f"ablation {name:42s} KL(oracle variant || llama.cpp) mean {k:.2e}", flush=True)
    return report


# ------------------------------------------------------------------ mla

def cmd_mla(args, exe, tmp):
    import make_mla_model
    import mla_ref
    from golden_lib import run_prompt
    from make_golden_mla import build_prompts
    report = {"variants": []}
    for layout in ("split", "legacy"):
        for qlr in (0, 96):
            path = tmp / f"mla_{layout}_q{qlr}.gguf"
            make_mla_model.write_model(path, qlr, layout)
            model = mla_ref.load_model(path)
            lc = LlamaCpp(exe, path, tmp)
            prompts, _ = build_prompts(path)
            kls, ags, geq, recs = [], [], [], []
            for pname, kind, text, ids in prompts:
                if kind == "text":
                    assert lc.tokenize(text) == ids, "tokenizer_ref differs from llama.cpp"
                pos = list(range(len(ids)))
                lg, g_llama = lc.logits(ids, pos, 32)
                entry, rows = run_prompt(mla_ref, model, ids, set(pos))
                lp = np.stack([rows[p] for p in pos])
                kl = kl_rows(lp, lg)
                n_eq, gs = greedy_report(entry["greedy"], g_llama, entry["greedy_top2_margin"])
                kls.append(kl)
                ags.append(lp.argmax(-1) == lg.argmax(-1))
                geq.append(n_eq)
                recs.append({"name": pname, "n_tokens": len(ids),
                             **stats(kl, lp.argmax(-1), lg.argmax(-1)), "greedy_equal_prefix": n_eq})
            kl, ag = np.concatenate(kls), np.concatenate(ags)
            v = {"layout": layout, "q_lora_rank": qlr, "positions": int(len(kl)),
                 "top1_agree": float(ag.mean()), "kl_mean": float(kl.mean()),
                 "kl_max": float(kl.max()), "greedy_equal": f"{sum(geq)}/{32 * len(geq)}",
                 "prompts": recs}
            # absorbed == naive on this model
            ids = prompts[-1][3]
            d = np.abs(mla_ref.forward(model, ids, np.float64, absorbed=True) -
                       mla_ref.forward(model, ids, np.float64)).max()
            v["absorbed_vs_naive_max_abs_logit_diff"] = float(d)
            report["variants"].append(v)
            print(f"mla layout={layout:6s} q_lora_rank={qlr:2d}: {len(kl)} positions, top-1 "
                  f"{ag.mean():.4f}, KL mean {kl.mean():.2e} max {kl.max():.2e}, greedy equal "
                  f"{sum(geq)}/{32 * len(geq)} tokens; absorbed-vs-naive max |dlogit| {d:.1e}",
                  flush=True)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["gemma3", "mla"])
    ap.add_argument("--model", default=str(REPO / "models/gemma-3-270m-Q4_K_M.gguf"))
    ap.add_argument("--build-dir", default="/tmp/kvserve-llamacpp-dump")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--only", action="append", help="gemma3: only this prompt (repeatable)")
    ap.add_argument("--no-extras", action="store_true", help="gemma3: skip probe and ablations")
    ap.add_argument("--f32", action="store_true",
                    help="gemma3: run llama.cpp on an F32 dequantized copy of the model "
                         "(written to --build-dir, ~1 GB), removing its activation quantization")
    args = ap.parse_args(argv)
    exe = build_dumper(Path(args.build_dir))
    with tempfile.TemporaryDirectory() as td:
        rep = (cmd_gemma3 if args.what == "gemma3" else cmd_mla)(args, exe, Path(td))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
