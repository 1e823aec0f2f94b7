// Batch driver over llama.cpp's own tokenizer (a second, independent implementation used to
// judge the HF oracle where the two disagree; see tests/tokenizer/compare_llama_tokenize.py).
// Reads JSON strings, one per line, on stdin; prints each one's ids twice as JSON arrays:
// add_special + parse_special, then neither. Built against the peer llama.cpp tree
// (bench/peer), not by CMake.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "llama.h"

static std::vector<llama_token> tokenize(const llama_vocab* vocab, const std::string& text, bool add_special,
                                         bool parse_special) {
  std::vector<llama_token> out(text.size() + 8);
  int32_t n = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), out.data(),
                             static_cast<int32_t>(out.size()), add_special, parse_special);
  if (n < 0) {
    out.resize(static_cast<size_t>(-n));
    n = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), out.data(),
                       static_cast<int32_t>(out.size()), add_special, parse_special);
  }
  out.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return out;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s model.gguf < strings.jsonl\n", argv[0]);
    return 2;
  }
  llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.vocab_only = true;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) {
    std::fprintf(stderr, "cannot load %s\n", argv[1]);
    return 1;
  }
  const llama_vocab* vocab = llama_model_get_vocab(model);
  std::string line;
  while (std::getline(std::cin, line)) {
    const std::string text = nlohmann::json::parse(line).get<std::string>();
    std::cout << nlohmann::json(tokenize(vocab, text, true, true)).dump() << "\n"
              << nlohmann::json(tokenize(vocab, text, false, false)).dump() << "\n";
  }
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
