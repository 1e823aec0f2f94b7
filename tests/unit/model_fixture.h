// Shared access to the real default model for tests: opened once per test binary.
#pragma once
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "gguf/gguf.h"
#include "kernels/matmul.h"
#include "model/llama.h"
#include "tokenizer/tokenizer.h"

namespace kvtest {

inline std::string smollm2_path() { return std::string(KV_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"; }

// Fails the calling test (never skips) when the model is missing: CI must fetch it.
inline const kv::GgufFile* smollm2_file() {
  static std::unique_ptr<kv::GgufFile> file = [] {
    auto f = kv::GgufFile::open(smollm2_path());
    return f ? std::move(*f) : nullptr;
  }();
  if (!file) ADD_FAILURE() << "cannot open " << smollm2_path() << ": run `make models`";
  return file.get();
}

inline kv::LlamaModel* smollm2_model() {
  static std::unique_ptr<kv::LlamaModel> model = []() -> std::unique_ptr<kv::LlamaModel> {
    const kv::GgufFile* f = smollm2_file();
    if (!f) return nullptr;
    auto m = kv::LlamaModel::load(*f, kv::detect_isa());
    if (!m) {
      ADD_FAILURE() << m.message();
      return nullptr;
    }
    return std::move(*m);
  }();
  return model.get();
}

inline const kv::Tokenizer* smollm2_tokenizer() {
  static std::unique_ptr<kv::Tokenizer> tok = []() -> std::unique_ptr<kv::Tokenizer> {
    const kv::GgufFile* f = smollm2_file();
    if (!f) return nullptr;
    auto t = kv::Tokenizer::from_gguf(*f);
    return t ? std::move(*t) : nullptr;
  }();
  return tok.get();
}

inline std::string gemma3_path() { return std::string(KV_SOURCE_DIR) + "/models/gemma-3-270m-Q4_K_M.gguf"; }

// Gemma 3 270M (hybrid: sliding-window + global layers), opened once; fails when missing.
inline kv::LlamaModel* gemma3_model() {
  static std::unique_ptr<kv::GgufFile> file = [] {
    auto f = kv::GgufFile::open(gemma3_path());
    return f ? std::move(*f) : nullptr;
  }();
  static std::unique_ptr<kv::LlamaModel> model = []() -> std::unique_ptr<kv::LlamaModel> {
    if (!file) return nullptr;
    auto m = kv::LlamaModel::load(*file, kv::detect_isa());
    if (!m) {
      ADD_FAILURE() << m.message();
      return nullptr;
    }
    return std::move(*m);
  }();
  if (!file) ADD_FAILURE() << "cannot open " << gemma3_path() << ": run `make models`";
  return model.get();
}

}  // namespace kvtest
