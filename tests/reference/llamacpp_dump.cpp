// Second implementation for the numpy oracle: llama.cpp (the peer build in bench/peer/work)
// run on the same GGUF and the same token ids. Not part of the engine or of any test target;
// tests/reference/compare_llamacpp.py compiles it against the peer's static libraries and
// drives it.
//
//   llamacpp_dump MODEL tokenize TEXTFILE
//       prints llama_tokenize(text, add_special=true, parse_special=true) as comma-separated ids
//   llamacpp_dump MODEL logits IDSFILE OUTFILE POSITIONS [N_GREEDY]
//       IDSFILE: comma-separated prompt ids. POSITIONS: comma-separated prompt positions
//       (or "all"). Decodes the prompt in one batch and writes float32 logits
//       [n_positions][n_vocab] (little-endian, no header) to OUTFILE; then, if N_GREEDY > 0,
//       continues greedily and prints "greedy: id,id,..." on stdout.
//
// Env: LLAMA_DUMP_THREADS (default 2); LLAMA_DUMP_OVERRIDE="key=int:N" or "key=float:X"
// overrides one GGUF metadata value (e.g. gemma3.attention.sliding_window=int:16 to probe
// the sliding-window boundary with a short prompt).
//
// Context: F32 K/V cache, flash attention off, full-size SWA cache, one sequence, so that
// llama.cpp's own noise is mostly its quantized activations (Q8_K / Q8_0 dot products).
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static std::vector<int> parse_ids(const std::string & s) {
    std::vector<int> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (item.find_first_not_of(" \n\r\t") == std::string::npos) continue;
        out.push_back(std::atoi(item.c_str()));
    }
    return out;
}

static std::string slurp(const char * path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) { std::fprintf(stderr, "cannot read %s\n", path); std::exit(2); }
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL tokenize TEXTFILE | MODEL logits IDSFILE OUTFILE POSITIONS [N_GREEDY]\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    std::vector<llama_model_kv_override> ov(2);
    std::memset(ov.data(), 0, sizeof(llama_model_kv_override) * ov.size());
    if (const char * o = std::getenv("LLAMA_DUMP_OVERRIDE")) {
        std::string s(o);
        size_t eq = s.find('='), colon = s.find(':', eq == std::string::npos ? 0 : eq);
        if (eq == std::string::npos || colon == std::string::npos || eq >= sizeof(ov[0].key)) {
            std::fprintf(stderr, "bad LLAMA_DUMP_OVERRIDE %s\n", o);
            return 2;
        }
        std::memcpy(ov[0].key, s.data(), eq);
        const std::string type = s.substr(eq + 1, colon - eq - 1), val = s.substr(colon + 1);
        if (type == "int") {
            ov[0].tag = LLAMA_KV_OVERRIDE_TYPE_INT;
            ov[0].val_i64 = std::atoll(val.c_str());
        } else if (type == "float") {
            ov[0].tag = LLAMA_KV_OVERRIDE_TYPE_FLOAT;
            ov[0].val_f64 = std::atof(val.c_str());
        } else {
            std::fprintf(stderr, "bad LLAMA_DUMP_OVERRIDE type %s\n", type.c_str());
            return 2;
        }
        mp.kv_overrides = ov.data();
    }
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { std::fprintf(stderr, "load failed\n"); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const std::string mode = argv[2];

    if (mode == "tokenize") {
        std::string text = slurp(argv[3]);
        std::vector<llama_token> toks(text.size() + 16);
        int n = llama_tokenize(vocab, text.data(), (int) text.size(), toks.data(), (int) toks.size(), true, true);
        if (n < 0) { std::fprintf(stderr, "tokenize failed\n"); return 1; }
        for (int i = 0; i < n; i++) std::printf(i ? ",%d" : "%d", toks[i]);
        std::printf("\n");
        llama_model_free(model);
        return 0;
    }
    if (mode != "logits" || argc < 6) { std::fprintf(stderr, "bad mode/args\n"); return 2; }

    std::vector<int> ids = parse_ids(slurp(argv[3]));
    const int T = (int) ids.size();
    const int n_greedy = argc > 6 ? std::atoi(argv[6]) : 0;
    std::vector<int> positions;
    if (std::string(argv[5]) == "all") {
        for (int i = 0; i < T; i++) positions.push_back(i);
    } else {
        positions = parse_ids(argv[5]);
    }
    const int n_vocab = llama_vocab_n_tokens(vocab);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (T + n_greedy + 16);
    cp.n_batch = (uint32_t) T;
    cp.n_ubatch = (uint32_t) T;
    cp.n_seq_max = 1;
    const char * thr = std::getenv("LLAMA_DUMP_THREADS");
    cp.n_threads = cp.n_threads_batch = thr ? std::atoi(thr) : 2;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.swa_full = true;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { std::fprintf(stderr, "context failed\n"); return 1; }

    llama_batch batch = llama_batch_init(T, 0, 1);
    std::vector<char> want(T, 0);
    for (int p : positions) {
        if (p < 0 || p >= T) { std::fprintf(stderr, "bad position %d\n", p); return 2; }
        want[p] = 1;
    }
    want[T - 1] = 1;  // always needed for greedy
    batch.n_tokens = T;
    for (int i = 0; i < T; i++) {
        batch.token[i] = ids[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = want[i];
    }
    if (llama_decode(ctx, batch) != 0) { std::fprintf(stderr, "decode failed\n"); return 1; }

    FILE * out = std::fopen(argv[4], "wb");
    if (!out) { std::fprintf(stderr, "cannot write %s\n", argv[4]); return 1; }
    for (int p : positions) {
        const float * l = llama_get_logits_ith(ctx, p);
        std::fwrite(l, sizeof(float), (size_t) n_vocab, out);
    }
    std::fclose(out);

    if (n_greedy > 0) {
        std::vector<int> cont;
        const float * l = llama_get_logits_ith(ctx, T - 1);
        for (int s = 0; s < n_greedy; s++) {
            int best = 0;
            for (int v = 1; v < n_vocab; v++) if (l[v] > l[best]) best = v;
            cont.push_back(best);
            if (s + 1 == n_greedy) break;
            llama_batch one = llama_batch_init(1, 0, 1);
            one.n_tokens = 1;
            one.token[0] = best;
            one.pos[0] = T + s;
            one.n_seq_id[0] = 1;
            one.seq_id[0][0] = 0;
            one.logits[0] = 1;
            if (llama_decode(ctx, one) != 0) { std::fprintf(stderr, "decode failed\n"); return 1; }
            llama_batch_free(one);
            l = llama_get_logits_ith(ctx, 0);
        }
        std::printf("greedy: ");
        for (size_t i = 0; i < cont.size(); i++) std::printf(i ? ",%d" : "%d", cont[i]);
        std::printf("\n");
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
