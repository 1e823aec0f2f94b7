// Tiny driver for differential testing (tests/tokenizer/fuzz_compare.py): reads JSON strings,
// one per line, from stdin and prints each one's ids as a JSON array (parse_special on, then
// off), one line each. Built by fuzz_compare.py, not by CMake.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s model.gguf < strings.jsonl\n", argv[0]);
    return 2;
  }
  auto f = kv::GgufFile::open(argv[1]);
  if (!f) {
    std::fprintf(stderr, "%s\n", f.message().c_str());
    return 1;
  }
  auto tok = kv::Tokenizer::from_gguf(**f);
  if (!tok) {
    std::fprintf(stderr, "%s\n", tok.message().c_str());
    return 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    const std::string text = nlohmann::json::parse(line).get<std::string>();
    std::cout << nlohmann::json((*tok)->encode(text, true, true)).dump() << "\n"
              << nlohmann::json((*tok)->encode(text, false, false)).dump() << "\n";
  }
  return 0;
}
