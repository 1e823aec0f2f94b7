// The continuous-batching engine on the real model, driven step by step (no thread).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>

#include "engine/engine.h"
#include "model_fixture.h"
#include "tokenizer/tokenizer.h"

using namespace kv;

namespace {
using kvtest::smollm2_tokenizer;

struct Outcome {
  std::map<int, std::string> text;
  std::map<int, std::string> finish;
  std::map<int, std::vector<int32_t>> tokens;
  Usage usage;
};

std::shared_ptr<RequestStream> submit(Engine& e, const std::vector<int32_t>& prompt, int max_tokens, int n = 1,
                                      std::vector<std::string> stop = {}, const SamplingParams& sp = {}, int32_t min_tokens = 0) {
  Request r;
  r.params.sampling = sp;
  r.params.min_tokens = min_tokens;
  r.id = e.next_request_id();
  r.prompt = prompt;
  r.params.max_tokens = max_tokens;
  r.params.n = n;
  r.params.stop = std::move(stop);
  r.params.ignore_eos = true;
  r.stream = std::make_shared<RequestStream>();
  Rejection rej = e.submit(r);
  EXPECT_EQ(rej.http_status, 0) << rej.message;
  return r.stream;
}

Outcome collect(RequestStream& s) {
  Outcome o;
  std::vector<StreamEvent> evs;
  s.pop(&evs, std::chrono::milliseconds(0));
  for (auto& ev : evs) {
    if (ev.kind == StreamEvent::kText) o.text[ev.index] += ev.text;
    if (ev.kind == StreamEvent::kText) o.tokens[ev.index].insert(o.tokens[ev.index].end(), ev.tokens.begin(), ev.tokens.end());
    if (ev.kind == StreamEvent::kFinish) o.finish[ev.index] = ev.finish_reason;
  }
  o.usage = s.usage();
  return o;
}

void run_until_idle(Engine& e) {
  for (int i = 0; i < 100000 && e.step(); ++i) {
    ASSERT_TRUE(e.check_integrity().is_ok()) << e.check_integrity().message();
  }
}

// After every request ended: no page is held by a request; what is still in use belongs to the
// prefix cache alone; every refcount is accounted for.
void expect_drained(const Engine& e) {
  EXPECT_EQ(e.pages_in_use(), 0);
  EXPECT_EQ(e.pool().n_used(), e.pages_cached());
  if (e.pool_g1()) {
    EXPECT_EQ(e.pool_g1()->n_used(), e.window_pages_cached());
  }
  Status st = e.check_integrity();
  EXPECT_TRUE(st.is_ok()) << st.message();
}

std::vector<int32_t> prompt_of(const Tokenizer& tok, const std::string& s) { return tok.encode(s, true, true); }

EngineConfig small_config(int64_t pages) {
  EngineConfig c;
  c.max_num_batched_tokens = 64;
  c.max_num_seqs = 32;
  c.max_model_len = 512;
  c.block_size = 16;
  c.kv_cache_bytes = pages * 16 * 23040;  // SmolLM2 f16: 23040 bytes per token
  c.n_threads = 2;
  return c;
}

const char* kPrompts[] = {
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
    "A haiku about autumn leaves:",
    "SELECT name, COUNT(*) FROM orders",
    "The mitochondria is",
    "In 1969, the first humans",
    "Photosynthesis converts",
    "The quick brown fox",
    "To be or not to be,",
    "import numpy as np\nx = np.",
    "Water boils at",
    "The largest planet in the solar system",
    "My favourite recipe for pancakes",
};
}  // namespace

TEST(Engine, BatchInvarianceAloneVsAmongFifteen) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  std::string alone;
  {
    Engine e(*m, *tok, small_config(512));
    auto s = submit(e, prompt_of(*tok, kPrompts[0]), 24);
    run_until_idle(e);
    alone = collect(*s).text[0];
    expect_drained(e);
  }
  Engine e(*m, *tok, small_config(512));
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const char* p : kPrompts) streams.push_back(submit(e, prompt_of(*tok, p), 24));
  run_until_idle(e);
  Outcome o = collect(*streams[0]);
  EXPECT_EQ(o.text[0], alone);  // bit-identical tokens, so identical text
  EXPECT_EQ(o.finish[0], "length");
  EXPECT_EQ(o.usage.completion_tokens, 24);
  expect_drained(e);
  EXPECT_TRUE(e.check_integrity().is_ok());
  // Every other request also equals its solo run.
  for (size_t i = 1; i < 4; ++i) {
    Engine solo(*m, *tok, small_config(512));
    auto s = submit(solo, prompt_of(*tok, kPrompts[i]), 24);
    run_until_idle(solo);
    EXPECT_EQ(collect(*streams[i]).text[0], collect(*s).text[0]) << kPrompts[i];
  }
}

TEST(Engine, SeededSamplingIsBatchInvariant) {
  // Temperature > 0 with top-p and a seed per request: the tokens depend on the request alone,
  // not on which other sequences share its steps or which pool thread samples it. n = 2
  // checks the forked choices too; min_tokens (the end of text masked for the first 12 tokens)
  // on every other request.
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  auto params = [](size_t i) {
    SamplingParams sp;
    sp.temperature = 0.8f;
    sp.top_p = 0.95f;
    sp.seed = 1000 + i;
    if (i % 3 == 1) sp.top_k = 40;
    if (i % 3 == 2) sp.min_p = 0.05f, sp.frequency_penalty = 0.3f;
    return sp;
  };
  Engine e(*m, *tok, small_config(512));
  std::vector<std::shared_ptr<RequestStream>> streams;
  auto min_tokens = [](size_t i) { return i % 2 == 0 ? 12 : 0; };
  for (size_t i = 0; i < 16; ++i)
    streams.push_back(submit(e, prompt_of(*tok, kPrompts[i]), 20, i == 0 ? 2 : 1, {}, params(i), min_tokens(i)));
  run_until_idle(e);
  expect_drained(e);
  for (size_t i : {0, 1, 2, 5}) {
    Engine solo(*m, *tok, small_config(512));
    auto s = submit(solo, prompt_of(*tok, kPrompts[i]), 20, i == 0 ? 2 : 1, {}, params(i), min_tokens(i));
    run_until_idle(solo);
    const Outcome a = collect(*streams[i]), b = collect(*s);
    EXPECT_EQ(a.text, b.text) << kPrompts[i];
    EXPECT_FALSE(a.text.at(0).empty());
    if (i == 0) {
      EXPECT_NE(a.text.at(0), a.text.at(1));  // the two choices drew differently
    }
  }
}

TEST(Engine, PreemptionUnderPagePressureKeepsOutputs) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  std::vector<std::string> solo;
  for (int i = 0; i < 6; ++i) {
    Engine e(*m, *tok, small_config(64));
    auto s = submit(e, prompt_of(*tok, kPrompts[i]), 40);
    run_until_idle(e);
    solo.push_back(collect(*s).text[0]);
  }
  // 6 sequences × up to 4 pages each do not fit in 12 pages at once.
  Engine e(*m, *tok, small_config(12));
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 6; ++i) streams.push_back(submit(e, prompt_of(*tok, kPrompts[i]), 40));
  run_until_idle(e);
  EXPECT_GT(e.metrics().num_preemptions_total, 0);
  for (int i = 0; i < 6; ++i) {
    Outcome o = collect(*streams[i]);
    EXPECT_EQ(o.text[0], solo[i]) << kPrompts[i];
    EXPECT_EQ(o.finish[0], "length");
  }
  expect_drained(e);
  EXPECT_TRUE(e.check_integrity().is_ok());
}

TEST(Engine, ParallelSamplingSharesPromptPages) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  Engine e(*m, *tok, small_config(64));
  // 40-token prompt: 2 full pages shared, the tail page copied on write.
  std::vector<int32_t> prompt = prompt_of(*tok, "Here is a long story about a dragon who lived in a cave near a mountain village, and every morning the dragon would");
  auto s = submit(e, prompt, 8, 3);
  int32_t max_used = 0;
  while (e.step()) max_used = std::max(max_used, e.pool().n_used());
  Outcome o = collect(*s);
  ASSERT_EQ(o.text.size(), 3u);
  EXPECT_EQ(o.text[0], o.text[1]);  // greedy: every choice is the same
  EXPECT_EQ(o.text[1], o.text[2]);
  EXPECT_EQ(o.usage.completion_tokens, 24);
  const int32_t unshared = 3 * BlockTable::pages_for(prompt.size() + 8, 16);
  EXPECT_LT(max_used, unshared);
  expect_drained(e);
}

TEST(Engine, StopStringIsNeverEmitted) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  std::string full;
  {
    Engine e(*m, *tok, small_config(64));
    auto s = submit(e, prompt_of(*tok, kPrompts[2]), 32);
    run_until_idle(e);
    full = collect(*s).text[0];
  }
  ASSERT_GT(full.size(), 20u);
  // A stop string that straddles the middle of the output.
  const std::string stop = full.substr(full.size() / 2, 5);
  Engine e(*m, *tok, small_config(64));
  auto s = submit(e, prompt_of(*tok, kPrompts[2]), 32, 1, {stop});
  run_until_idle(e);
  Outcome o = collect(*s);
  EXPECT_EQ(o.finish[0], "stop");
  EXPECT_EQ(o.text[0], full.substr(0, full.find(stop)));
}

// vLLM's min_tokens on a chat answer that ends early (greedy): the end of text cannot be drawn
// before min_tokens tokens, nor a stop_token_id; a stop string in their text does not end the
// answer, one ending in a later token's text does; logprobs stay the raw distribution's.
TEST(Engine, MinTokensHoldsOffTheEndOfTextStopIdsAndStopStrings) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  const std::vector<int32_t> prompt = prompt_of(*tok, "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n");
  struct Run {
    std::vector<int32_t> tokens;
    std::string text, finish;
    std::vector<TokenLogprob> lps;  // every token's, the end of text's included
  };
  auto run = [&](int32_t min_tokens, std::vector<std::string> stop = {}, std::vector<int32_t> stop_ids = {}) {
    Engine e(*m, *tok, small_config(256));
    Request r;
    r.id = e.next_request_id();
    r.prompt = prompt;
    r.params.max_tokens = 48;
    r.params.min_tokens = min_tokens;
    r.params.stop = std::move(stop);
    r.params.stop_token_ids = std::move(stop_ids);
    r.params.logprobs = 3;
    r.stream = std::make_shared<RequestStream>();
    EXPECT_EQ(e.submit(r).http_status, 0);
    run_until_idle(e);
    expect_drained(e);
    Run out;
    std::vector<StreamEvent> evs;
    r.stream->pop(&evs, std::chrono::milliseconds(0));
    for (auto& ev : evs) {
      out.tokens.insert(out.tokens.end(), ev.tokens.begin(), ev.tokens.end());
      out.text += ev.text;
      for (auto* v : {&ev.logprobs, &ev.eog_logprobs}) out.lps.insert(out.lps.end(), v->begin(), v->end());
      if (ev.kind == StreamEvent::kFinish) out.finish = ev.finish_reason;
    }
    EXPECT_EQ(out.lps.size(), out.tokens.size());
    return out;
  };
  const Run free = run(0);
  const size_t L = free.tokens.size();  // the answer, then the end of text
  ASSERT_EQ(free.finish, "stop");
  ASSERT_TRUE(tok->is_eog(free.tokens.back()));
  ASSERT_LT(L, 20u);
  const Run held = run(20);
  ASSERT_GE(held.tokens.size(), 20u);
  for (size_t i = 0; i < 20; ++i) EXPECT_FALSE(tok->is_eog(held.tokens[i])) << i;
  EXPECT_TRUE(std::equal(free.tokens.begin(), free.tokens.end() - 1, held.tokens.begin()));  // the same answer up to there
  EXPECT_EQ(held.finish, tok->is_eog(held.tokens.back()) ? "stop" : "length");
  if (held.tokens.size() < 48) {
    EXPECT_EQ(held.finish, "stop");
  }
  // The logprobs where the free run drew the end of text are the raw distribution's (vLLM's
  // default): the end of text is still in the top, with the same value, though it was not drawn.
  const TokenLogprob& at = held.lps[L - 1];
  EXPECT_NE(at.token, free.tokens.back());
  ASSERT_EQ(at.top.size(), free.lps[L - 1].top.size());
  for (size_t k = 0; k < at.top.size(); ++k) {
    EXPECT_EQ(at.top[k].first, free.lps[L - 1].top[k].first);
    EXPECT_FLOAT_EQ(at.top[k].second, free.lps[L - 1].top[k].second);
  }
  EXPECT_EQ(at.top[0].first, free.tokens.back());
  // The end of text may come as token min_tokens + 1: min_tokens = L - 1 changes nothing.
  EXPECT_EQ(run(static_cast<int32_t>(L) - 1).tokens, free.tokens);

  // A stop string inside the first min_tokens tokens' text does not end the answer; the first one
  // that ends in a later token's text does.
  const std::string full = held.text;
  const size_t first_q = free.text.find('.');
  ASSERT_NE(first_q, std::string::npos);  // the free answer has a "." early
  EXPECT_EQ(run(0, {"."}).text, free.text.substr(0, first_q));
  const std::string text20 = tok->decode(std::vector<int32_t>(held.tokens.begin(), held.tokens.begin() + 20));
  const Run cut = run(20, {"."});
  const size_t next = full.find('.', text20.size());
  EXPECT_EQ(cut.text, full.substr(0, next));
  EXPECT_EQ(cut.finish, next == std::string::npos ? held.finish : "stop");
  // A stop string begun inside them and ended after them counts (vLLM's search starts
  // len(stop) - 1 characters back): the two characters across the boundary.
  const std::string across = full.substr(text20.size() - 1, 2);
  ASSERT_EQ(across.size(), 2u);
  const Run straddle = run(20, {across});
  const size_t at_across = full.find(across, text20.size() - 1);
  EXPECT_EQ(straddle.text, full.substr(0, at_across));
  EXPECT_EQ(straddle.finish, "stop");

  // stop_token_ids are held off too: the free answer's third token as a stop id ends it there,
  // not before min_tokens.
  const int32_t third = free.tokens[2];
  const Run stop_id = run(0, {}, {third});
  EXPECT_EQ(stop_id.tokens.size(), 3u);
  EXPECT_EQ(stop_id.finish, "stop");
  const Run stop_id10 = run(10, {}, {third});
  ASSERT_GE(stop_id10.tokens.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_NE(stop_id10.tokens[i], third) << i;
}

TEST(Engine, RejectsWhatCanNeverFit) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  EngineConfig c = small_config(8);  // 128 tokens of KV
  c.max_queue = 2;
  c.max_num_seqs = 1;  // the queue counts requests beyond the free sequence slots
  Engine e(*m, *tok, c);
  Request r;
  r.prompt = prompt_of(*tok, "hello");
  r.params.max_tokens = 600;
  r.stream = std::make_shared<RequestStream>();
  EXPECT_EQ(e.submit(r).http_status, 400);  // over max_model_len
  r.params.max_tokens = 200;
  Rejection rej = e.submit(r);
  EXPECT_EQ(rej.http_status, 400);  // more pages than the pool
  EXPECT_NE(rej.message.find("KV"), std::string::npos);
  r.params.max_tokens = 4;
  r.params.n = 0;
  EXPECT_EQ(e.submit(r).http_status, 400);
  r.params.n = 1;
  // Non-finite sampling values (a CLI once passed `--min-p nan` through, which hung the sampler).
  for (float bad : {std::nanf(""), INFINITY}) {
    r.params.sampling.min_p = bad;
    Rejection nan_rej = e.submit(r);
    EXPECT_EQ(nan_rej.http_status, 400);
    EXPECT_EQ(nan_rej.param, "min_p");
  }
  r.params.sampling.min_p = 0.f;
  r.params.sampling.temperature = std::nanf("");
  EXPECT_EQ(e.submit(r).param, "temperature");
  r.params.sampling.temperature = 0.f;
  EXPECT_EQ(e.submit(r).http_status, 0);  // the free slot
  EXPECT_EQ(e.submit(r).http_status, 0);  // the queue
  EXPECT_EQ(e.submit(r).http_status, 0);
  EXPECT_EQ(e.submit(r).http_status, 429);  // queue full
  run_until_idle(e);
  expect_drained(e);
}

TEST(Engine, CancelFreesPagesWithinOneStep) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  Engine e(*m, *tok, small_config(64));
  auto s = submit(e, prompt_of(*tok, kPrompts[3]), 200);
  for (int i = 0; i < 3; ++i) e.step();
  EXPECT_GT(e.pool().n_used(), 0);
  s->cancel();
  e.step();
  expect_drained(e);
  Outcome o = collect(*s);
  EXPECT_EQ(o.finish[0], "abort");
  EXPECT_TRUE(s->done());
}

TEST(Engine, LongPromptsInATinyPoolNeverLivelock) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  std::string story = "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
                      "listening to the waves, and thinking about the ships that had passed in the night.";
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 3; ++i) prompts.push_back(prompt_of(*tok, std::string(i + 1, '#') + " " + story));
  std::vector<std::string> solo;
  for (const auto& p : prompts) {
    Engine e(*m, *tok, small_config(64));
    auto s = submit(e, p, 8);
    run_until_idle(e);
    solo.push_back(collect(*s).text[0]);
  }
  // 5 pages = 80 positions; three ~40-token prompts admitted together advance a page each per
  // step until every one is mid-prompt with no free page: only preemption gets out of that.
  EngineConfig c = small_config(5);
  c.max_num_batched_tokens = 48;
  Engine e(*m, *tok, c);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& p : prompts) streams.push_back(submit(e, p, 8));
  run_until_idle(e);
  for (size_t i = 0; i < prompts.size(); ++i) {
    Outcome o = collect(*streams[i]);
    EXPECT_TRUE(streams[i]->done()) << i;
    EXPECT_EQ(o.finish[0], "length") << i;
    EXPECT_EQ(o.text[0], solo[i]) << i;
  }
  EXPECT_GT(e.metrics().num_preemptions_total, 0);
  expect_drained(e);
}

// A long prompt in prefill does not hold back a short request that arrives behind it: with
// long_prefill_tokens, the long prompt's chunk is cut on the first pass and the short one is
// admitted in the same step; what the step leaves over still goes to the long prompt (alone it
// takes as few steps as without the cap). Outputs equal each prompt's alone.
TEST(Engine, ShortRequestsAreNotStuckBehindALongPrefill) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  std::string doc;
  for (int i = 0; i < 16; ++i) doc += "Paragraph " + std::to_string(i) + " of a long report on lighthouse keeping and the sea. ";
  const std::vector<int32_t> longp = prompt_of(*tok, doc), shortp = prompt_of(*tok, "The capital of France is");
  ASSERT_GT(longp.size(), 192u);
  ASSERT_LT(shortp.size(), 16u);
  // Steps until s's first token, the text seen on the way added to *text.
  auto steps_to_first_token = [&](Engine& e, RequestStream& s, std::string* text) {
    int n = 0;
    while (n < 1000) {
      Outcome o = collect(s);
      if (!o.text.empty()) {
        *text += o.text[0];
        break;
      }
      if (!e.step()) break;
      ++n;
    }
    return n;
  };
  std::string solo_long, solo_short;
  int solo_steps[2] = {};
  for (int cap : {0, 16}) {
    EngineConfig c = small_config(64);
    c.long_prefill_tokens = cap;
    Engine e(*m, *tok, c);
    auto l = submit(e, longp, 4);
    solo_long.clear();
    solo_steps[cap ? 1 : 0] = steps_to_first_token(e, *l, &solo_long);
    run_until_idle(e);
    solo_long += collect(*l).text[0];
    auto s = submit(e, shortp, 24);
    run_until_idle(e);
    solo_short = collect(*s).text[0];
  }
  // Alone, the cut chunk gets the rest of the step back: as many steps as without the cap.
  EXPECT_EQ(solo_steps[1], solo_steps[0]);
  EXPECT_EQ(solo_steps[0], static_cast<int>((longp.size() + 63) / 64));
  for (int cap : {0, 16}) {
    EngineConfig c = small_config(64);
    c.long_prefill_tokens = cap;
    c.enable_prefix_caching = false;
    Engine e(*m, *tok, c);
    auto l = submit(e, longp, 4);
    e.step();  // the long prompt is admitted and computes its first chunk
    auto s = submit(e, shortp, 24);
    std::string short_text;
    const int steps = steps_to_first_token(e, *s, &short_text);
    if (cap) {
      EXPECT_EQ(steps, 1) << "the short request is admitted in the next step";
      EXPECT_TRUE(collect(*l).text.empty()) << "while the long prompt is still in prefill";
    } else {
      EXPECT_GT(steps, 2) << "without the cap it waits for the long prompt's prefill";
    }
    run_until_idle(e);
    Outcome os = collect(*s), ol = collect(*l);
    EXPECT_EQ(ol.text[0], solo_long) << cap;
    EXPECT_EQ(short_text + os.text[0], solo_short) << cap;
    expect_drained(e);
  }
}

TEST(Engine, PrefixHitNeverChangesOutputAndIsReported) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  const std::string system = "<|im_start|>system\nYou are a helpful assistant who answers in one short sentence, "
                             "politely, and never uses lists or tables.<|im_end|>\n";
  auto ask = [&](const std::string& q) { return prompt_of(*tok, system + "<|im_start|>user\n" + q + "<|im_end|>\n<|im_start|>assistant\n"); };
  EngineConfig off = small_config(64);
  off.enable_prefix_caching = false;
  std::vector<std::string> want;
  for (const char* q : {"What is the capital of Italy?", "Name a primary colour."}) {
    Engine e(*m, *tok, off);
    auto s = submit(e, ask(q), 12);
    run_until_idle(e);
    want.push_back(collect(*s).text[0]);
    EXPECT_EQ(e.pool().n_used(), 0);
  }
  Engine e(*m, *tok, small_config(64));
  auto s1 = submit(e, ask("What is the capital of Italy?"), 12);
  run_until_idle(e);
  Outcome o1 = collect(*s1);
  EXPECT_EQ(o1.usage.cached_tokens, 0);
  auto s2 = submit(e, ask("Name a primary colour."), 12);
  run_until_idle(e);
  Outcome o2 = collect(*s2);
  EXPECT_EQ(o1.text[0], want[0]);
  EXPECT_EQ(o2.text[0], want[1]);  // the hit reuses the system prompt's pages: same output
  // Every token the two prompts share: the system prompt's full pages from the cache, the rest
  // (up to the first token that differs) copied from the first prompt's page there.
  const auto p1 = ask("What is the capital of Italy?"), p2 = ask("Name a primary colour.");
  const int64_t shared = std::mismatch(p1.begin(), p1.end(), p2.begin(), p2.end()).first - p1.begin();
  ASSERT_GT(shared % 16, 0) << "the prompts must diverge inside a page for this test";
  EXPECT_EQ(o2.usage.cached_tokens, shared);
  MetricsSnapshot ms = e.metrics();
  EXPECT_EQ(ms.prefix_cache_hits_total, o2.usage.cached_tokens);
  EXPECT_EQ(ms.prefix_cache_partial_hits_total, shared % 16);
  EXPECT_GT(ms.prefix_cache_queries_total, ms.prefix_cache_hits_total);
  expect_drained(e);
}

// Chat requests that differ only in the user's words share the template's tokens up to a
// point inside a page: the cached page there is copied and its matching slots kept. Greedy and
// seeded sampled outputs equal those of an engine without a cache, also when the pool is so
// small that the copy must first evict (the cache's pages fill it), and with several requests
// admitted together; every page comes back.
TEST(Engine, PartialPageReuseNeverChangesOutput) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  std::vector<std::vector<int32_t>> prompts;
  for (const char* topic : {"a lighthouse", "a lost key", "the moon", "a red kite", "a lighthouse keeper", "winter"})
    prompts.push_back(prompt_of(*tok, std::string("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                                  "Hugging Face<|im_end|>\n<|im_start|>user\nWrite a short story about ") +
                                          topic + ".<|im_end|>\n<|im_start|>assistant\n"));
  // Prompt and output end one token past a page boundary (the last token is never computed):
  // every page of a finished request is cached, so a small pool is left with no free page.
  auto max_tokens = [&](size_t i) { return static_cast<int>(65 - prompts[i].size()); };
  for (size_t i = 0; i < prompts.size(); ++i) ASSERT_GE(max_tokens(i), 6);
  SamplingParams hot;
  hot.temperature = 0.8f;
  hot.top_p = 0.95f;
  auto params = [&](size_t i) {
    SamplingParams sp = i % 2 ? hot : SamplingParams{};
    sp.seed = 1000 + i;
    return sp;
  };
  std::vector<std::vector<int32_t>> want;
  {
    EngineConfig off = small_config(64);
    off.enable_prefix_caching = false;
    Engine e(*m, *tok, off);
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto s = submit(e, prompts[i], max_tokens(i), 1, {}, params(i));
      run_until_idle(e);
      want.push_back(collect(*s).tokens[0]);
    }
  }
  for (int64_t pages : {64, 5}) {  // 5: a request's 4 pages and one more; the copy must evict first
    Engine e(*m, *tok, small_config(pages));
    int64_t copied = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (pages == 5 && i >= 2) {
        EXPECT_EQ(e.pool().n_free(), 0) << i;
      }
      auto s = submit(e, prompts[i], max_tokens(i), 1, {}, params(i));
      run_until_idle(e);
      Outcome o = collect(*s);
      EXPECT_EQ(o.tokens[0], want[i]) << "request " << i << ", " << pages << " pages";
      if (i > 0) {
        const int64_t shared = std::mismatch(prompts[i].begin(), prompts[i].end(), prompts[i - 1].begin(), prompts[i - 1].end()).first -
                               prompts[i].begin();
        EXPECT_GE(o.usage.cached_tokens, std::min<int64_t>(shared, static_cast<int64_t>(prompts[i].size()) - 1)) << i;
        copied += o.usage.cached_tokens % 16;
      }
      expect_drained(e);
    }
    EXPECT_GT(copied, 0);
    EXPECT_EQ(e.metrics().prefix_cache_partial_hits_total, copied) << pages;
  }
  // Together: admitted in one step, each copies from the first request's cached page (the
  // others publish theirs only when full).
  Engine e(*m, *tok, small_config(64));
  auto first = submit(e, prompts[0], max_tokens(0), 1, {}, params(0));
  run_until_idle(e);
  EXPECT_EQ(collect(*first).tokens[0], want[0]);
  std::vector<std::shared_ptr<RequestStream>> ss;
  for (size_t i = 1; i < prompts.size(); ++i) ss.push_back(submit(e, prompts[i], max_tokens(i), 1, {}, params(i)));
  run_until_idle(e);
  for (size_t i = 1; i < prompts.size(); ++i) {
    Outcome o = collect(*ss[i - 1]);
    EXPECT_EQ(o.tokens[0], want[i]) << "together, request " << i;
    EXPECT_GT(o.usage.cached_tokens % 16, 0) << i;
  }
  expect_drained(e);
}

// Quantized pages would be quantized a second time: there the partly matching page is computed.
TEST(Engine, PartialPageReuseSkipsQuantizedPages) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  EngineConfig c = small_config(64);
  c.kv_dtype = KvDtype::kInt8;
  Engine e(*m, *tok, c);
  const auto a = prompt_of(*tok, "<|im_start|>user\nWrite a short story about the sea.<|im_end|>\n");
  const auto b = prompt_of(*tok, "<|im_start|>user\nWrite a short story about a cat.<|im_end|>\n");
  submit(e, a, 4);
  run_until_idle(e);
  auto s = submit(e, b, 4);
  run_until_idle(e);
  const int64_t shared = std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin();
  ASSERT_GT(shared % 16, 0);
  EXPECT_EQ(collect(*s).usage.cached_tokens, shared / 16 * 16);
  EXPECT_EQ(e.metrics().prefix_cache_partial_hits_total, 0);
  expect_drained(e);
}

TEST(Engine, NamespacesNeverShare) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  Engine e(*m, *tok, small_config(64));
  const auto prompt = prompt_of(*tok, "Tell me a long story about a brave little toaster that travels across the country to find its owner.");
  auto run = [&](const std::string& ns) {
    Request r;
    r.id = e.next_request_id();
    r.prompt = prompt;
    r.params.max_tokens = 4;
    r.params.cache_namespace = ns;
    r.stream = std::make_shared<RequestStream>();
    EXPECT_EQ(e.submit(r).http_status, 0);
    run_until_idle(e);
    return collect(*r.stream);
  };
  Outcome a = run("tenant-a");
  Outcome a2 = run("tenant-a");
  Outcome b = run("tenant-b");
  EXPECT_EQ(a.usage.cached_tokens, 0);
  EXPECT_GT(a2.usage.cached_tokens, 0);
  EXPECT_EQ(b.usage.cached_tokens, 0);  // same prompt, other namespace: a miss
  EXPECT_EQ(a.text[0], b.text[0]);
  expect_drained(e);
}

TEST(Engine, PagesArePublishedWhilePrefillRuns) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  std::string sys;
  for (int i = 0; i < 12; ++i) sys += "Rule " + std::to_string(i) + ": answer briefly, cite nothing, and stay polite. ";
  EngineConfig c = small_config(64);
  c.max_num_batched_tokens = 64;  // the shared prompt takes several steps
  Engine e(*m, *tok, c);
  auto a = submit(e, prompt_of(*tok, sys + "Q: red?"), 4);
  e.step();  // first chunk of a is computed and published
  auto b = submit(e, prompt_of(*tok, sys + "Q: blue?"), 4);
  run_until_idle(e);
  Outcome ob = collect(*b);
  // b arrived while a was still mid-prompt, and still reused a's first pages.
  EXPECT_GE(ob.usage.cached_tokens, 64);
  collect(*a);
  expect_drained(e);
}

// The KV dashboard's snapshots (kv_snapshot.h), step by step: two requests with one system prompt
// share its pages while they run; afterwards those pages are cached, the rest free, and the
// finished list holds both timelines.
TEST(Engine, DashboardSnapshotsFollowPagesRequestsAndTheTree) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  std::string sys;
  for (int i = 0; i < 6; ++i) sys += "Rule " + std::to_string(i) + ": answer briefly and stay polite. ";
  Engine e(*m, *tok, small_config(64));
  SnapshotFeed& feed = e.dashboard_feed();
  feed.set_interval(0);  // a snapshot after every step
  e.step();
  EXPECT_EQ(feed.wait_newer(0, std::chrono::milliseconds(0)), nullptr);  // nobody watches: none built
  feed.subscribe();
  auto first = submit(e, prompt_of(*tok, sys + "Q: red?"), 2);
  run_until_idle(e);
  auto a = submit(e, prompt_of(*tok, sys + "Q: green?"), 6);
  auto b = submit(e, prompt_of(*tok, sys + "Q: blue?"), 6);
  ASSERT_TRUE(e.step());
  auto s = feed.wait_newer(0, std::chrono::milliseconds(0));
  ASSERT_TRUE(s);
  ASSERT_EQ(s->pools.size(), 1u);
  const PoolView& p = s->pools[0];
  EXPECT_EQ(static_cast<int32_t>(p.states.size()), e.pool().n_pages());
  EXPECT_GT(p.n_shared, 0);  // the system prompt's pages, in both block tables
  EXPECT_GT(p.n_running, 0);
  EXPECT_EQ(p.n_running + p.n_shared, e.pages_in_use());
  int32_t n_running = 0, pages = 0;
  for (const RequestView& r : s->requests)
    if (r.state == RequestView::kRunning) {
      ++n_running;
      pages += r.n_pages;
      EXPECT_GT(r.cached_tokens, 0);
      ASSERT_FALSE(r.timeline.events.empty());
      EXPECT_EQ(r.timeline.events[0].kind, TimelineEvent::kPrefill);
      EXPECT_LE(r.timeline.arrival, r.timeline.events[0].t0);
    }
  EXPECT_EQ(n_running, 2);
  EXPECT_EQ(pages, 2 * p.n_shared + p.n_running);
  // The tree: the system prompt's node, hit by both, its text the prompt's start.
  ASSERT_FALSE(s->tree.nodes.empty());
  const PrefixTreeView::Node& root = s->tree.nodes[0];
  EXPECT_EQ(root.parent, -1);
  EXPECT_GE(root.hits, 2);
  EXPECT_TRUE(root.pinned);
  const std::vector<int32_t> sys_ids = prompt_of(*tok, sys);
  ASSERT_EQ(root.head.size(), static_cast<size_t>(DashboardRecorder::kSnippetTokens));
  EXPECT_EQ(root.head, std::vector<int32_t>(sys_ids.begin(), sys_ids.begin() + DashboardRecorder::kSnippetTokens));
  run_until_idle(e);
  collect(*first);
  collect(*a);
  collect(*b);
  e.step();  // an idle step still publishes
  s = feed.wait_newer(0, std::chrono::milliseconds(0));
  EXPECT_EQ(s->pools[0].n_running + s->pools[0].n_shared, 0);
  EXPECT_EQ(s->pools[0].n_cached, e.pages_cached());
  EXPECT_EQ(s->pools[0].n_free, e.pool().n_pages() - e.pages_cached());
  int32_t n_finished = 0;
  for (const RequestView& r : s->requests) {
    EXPECT_EQ(r.state, RequestView::kFinished);
    ++n_finished;
    EXPECT_EQ(r.timeline.finish_reason, "length");
    EXPECT_GT(r.timeline.first_token, r.timeline.arrival);
    EXPECT_EQ(r.timeline.events.back().kind, TimelineEvent::kFinished);
  }
  EXPECT_EQ(n_finished, 3);
  feed.unsubscribe();
  expect_drained(e);
}

TEST(Engine, LpmPrefersTheCachedPrefixFcfsDoesNot) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  std::string sys;
  for (int i = 0; i < 6; ++i) sys += "Guideline " + std::to_string(i) + ": be brief and kind. ";
  for (auto policy : {EngineConfig::Policy::kFcfs, EngineConfig::Policy::kLpm}) {
    EngineConfig c = small_config(64);
    c.max_num_seqs = 1;  // one admission at a time: the order is visible
    c.max_num_batched_tokens = 256;
    c.policy = policy;
    Engine e(*m, *tok, c);
    auto warm = submit(e, prompt_of(*tok, sys + "Q: one?"), 2);
    run_until_idle(e);
    collect(*warm);
    auto a = submit(e, prompt_of(*tok, "An unrelated question about the weather in Lisbon in spring?"), 2);
    auto b = submit(e, prompt_of(*tok, sys + "Q: two?"), 2);
    e.step();  // admits one request: prompt and first token
    e.step();  // its second (last) token: it finishes
    Outcome oa = collect(*a), ob = collect(*b);
    if (policy == EngineConfig::Policy::kLpm) {
      EXPECT_EQ(oa.finish.count(0), 0u);
      EXPECT_EQ(ob.finish[0], "length");  // b starts with a cached prefix: it goes first
    } else {
      EXPECT_EQ(oa.finish[0], "length");  // arrival order
      EXPECT_EQ(ob.finish.count(0), 0u);
    }
    run_until_idle(e);
    collect(*a);
    collect(*b);
    expect_drained(e);
  }
}

namespace {
std::unique_ptr<Tokenizer> gemma3_tokenizer() {
  auto f = GgufFile::open(kvtest::gemma3_path());
  if (!f.is_ok()) return nullptr;
  auto t = Tokenizer::from_gguf(**f);
  return t.is_ok() ? std::move(*t) : nullptr;
}

// Deterministic filler ids (ordinary vocabulary) after BOS.
std::vector<int32_t> filler(const Tokenizer& tok, size_t n, uint32_t salt) {
  std::vector<int32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(300 + (i * 7919 + salt * 104729) % 200000);
  v[0] = tok.bos_id();
  return v;
}
// n ordinary ids (no BOS): a prompt's continuation.
std::vector<int32_t> more(size_t n, uint32_t salt) {
  std::vector<int32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(300 + (i * 7919 + salt * 104729) % 200000);
  return v;
}
std::vector<int32_t> join(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

EngineConfig gemma_config() {
  EngineConfig c;
  c.max_num_batched_tokens = 128;
  c.max_num_seqs = 8;
  c.max_model_len = 1024;
  c.block_size = 16;
  c.kv_cache_bytes = 96ll << 20;
  c.n_threads = 2;
  return c;
}

// Outputs of prompts run one after another, each to completion, in one engine.
std::vector<Outcome> run_in_turn(Engine& e, const std::vector<std::vector<int32_t>>& prompts, int max_tokens) {
  std::vector<Outcome> out;
  for (const auto& p : prompts) {
    auto s = submit(e, p, max_tokens);
    run_until_idle(e);
    out.push_back(collect(*s));
  }
  return out;
}
}  // namespace

// Gemma 3 (hybrid: 3 global + 15 sliding-window layers, window 512) through the engine: two
// KV pools, the window's pages freed as it slides. A 700-token prompt decoded alone equals the
// same prompt decoded among other requests; n = 2 forks share (and copy-on-write) pages in both
// pools; every page of both pools returns. (Prefix caching off: the cache would keep pages; its
// hybrid behaviour has tests of its own below.)
TEST(Engine, Gemma3HybridSlidingWindowPools) {
  LlamaModel* m = kvtest::gemma3_model();
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(m->kv_groups().size(), 2u);
  ASSERT_EQ(m->kv_groups()[1].window, 512);
  auto tok = gemma3_tokenizer();
  ASSERT_NE(tok, nullptr);
  const std::vector<int32_t> longp = filler(*tok, 700, 0);
  EngineConfig c = gemma_config();
  c.enable_prefix_caching = false;
  std::string alone;
  {
    Engine e(*m, *tok, c);
    ASSERT_NE(e.pool_g1(), nullptr);
    auto s = submit(e, longp, 24);
    int64_t max_g1 = 0;
    for (int i = 0; i < 100000 && e.step(); ++i) {
      ASSERT_TRUE(e.check_integrity().is_ok()) << e.check_integrity().message();
      max_g1 = std::max<int64_t>(max_g1, e.pool_g1()->n_used());
    }
    alone = collect(*s).text[0];
    // the window (512 positions = 32 pages) plus one step's pages, never the whole 724
    EXPECT_LE(max_g1, 512 / 16 + 128 / 16 + 2);
    EXPECT_LT(max_g1, 724 / 16);
    expect_drained(e);
    EXPECT_EQ(e.pool_g1()->n_used(), 0);
  }
  ASSERT_FALSE(alone.empty());
  {
    Engine e(*m, *tok, c);
    auto a = submit(e, prompt_of(*tok, "The quick brown fox"), 30);
    auto s = submit(e, longp, 24);
    auto b = submit(e, prompt_of(*tok, "def fib(n):"), 20, 2);
    run_until_idle(e);
    EXPECT_EQ(collect(*s).text[0], alone);
    Outcome ob = collect(*b);
    EXPECT_EQ(ob.text.size(), 2u);
    expect_drained(e);
    EXPECT_EQ(e.pool_g1()->n_used(), 0);
  }
}

// Gemma 3 with the prefix cache on: a hit needs the global layers' pages of the whole prefix
// and the sliding-window layers' pages of its last window (512 positions). A 700-token shared
// prefix is computed once: a second request diverging after it, and a follow-up that extends
// the first request's prompt, reuse it with outputs identical to the cache off.
TEST(Engine, Gemma3PrefixCacheReusesGlobalPagesAndTheLastWindow) {
  LlamaModel* m = kvtest::gemma3_model();
  ASSERT_NE(m, nullptr);
  auto tok = gemma3_tokenizer();
  ASSERT_NE(tok, nullptr);
  const std::vector<int32_t> shared = filler(*tok, 700, 1);
  const std::vector<int32_t> a = join(shared, more(20, 2));
  const std::vector<int32_t> b = join(shared, more(30, 3));
  const std::vector<int32_t> c = join(a, more(40, 4));
  EngineConfig off = gemma_config();
  off.enable_prefix_caching = false;
  std::vector<Outcome> want;
  {
    Engine e(*m, *tok, off);
    want = run_in_turn(e, {a, b, c}, 16);
    expect_drained(e);
  }
  Engine e(*m, *tok, gemma_config());
  std::vector<Outcome> got = run_in_turn(e, {a, b, c}, 16);
  for (int i = 0; i < 3; ++i) {
    ASSERT_FALSE(want[i].text[0].empty());
    EXPECT_EQ(got[i].text[0], want[i].text[0]) << "request " << i;
  }
  EXPECT_EQ(got[0].usage.cached_tokens, 0);
  EXPECT_EQ(got[1].usage.cached_tokens, 700 / 16 * 16);  // the shared prefix's full pages
  EXPECT_EQ(got[2].usage.cached_tokens, 720);            // a's whole prompt (45 pages)
  EXPECT_GT(e.window_pages_cached(), 0);
  // the cache keeps the window pages it was handed, not only the last window
  EXPECT_GT(e.window_pages_cached(), 512 / 16 + 2);
  expect_drained(e);
}

// The same with a sliding-window pool too small to keep what the cache is handed: window pages
// are evicted (cache-only ones, oldest first) to let requests run; a prefix whose window went
// is recomputed. Outputs never change, every page is accounted for at every step.
TEST(Engine, Gemma3PrefixCacheUnderWindowPoolPressure) {
  LlamaModel* m = kvtest::gemma3_model();
  ASSERT_NE(m, nullptr);
  auto tok = gemma3_tokenizer();
  ASSERT_NE(tok, nullptr);
  // Two 600-token prefixes in turn: the pool cannot keep both windows beside a running request.
  const std::vector<int32_t> pa = filler(*tok, 600, 5), pb = filler(*tok, 600, 6);
  std::vector<std::vector<int32_t>> prompts;
  for (uint32_t i = 0; i < 6; ++i) prompts.push_back(join(i % 2 ? pb : pa, more(30 + 10 * i, 7 + i)));
  EngineConfig c = gemma_config();
  c.max_num_seqs = 2;  // the window pool holds about two sequences' windows
  EngineConfig off = c;
  off.enable_prefix_caching = false;
  std::vector<Outcome> want;
  {
    Engine e(*m, *tok, off);
    want = run_in_turn(e, prompts, 8);
  }
  Engine e(*m, *tok, c);
  ASSERT_NE(e.pool_g1(), nullptr);
  const int32_t n_window_pool = e.pool_g1()->n_pages();
  EXPECT_LT(n_window_pool, 3 * (600 / 16));
  std::vector<Outcome> got = run_in_turn(e, prompts, 8);
  int32_t n_hits = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[i].text[0], want[i].text[0]) << "request " << i;
    n_hits += got[i].usage.cached_tokens > 0;
    std::printf("request %zu: %d of %zu prompt tokens cached\n", i, got[i].usage.cached_tokens, prompts[i].size());
  }
  EXPECT_GE(n_hits, 2);
  EXPECT_GT(e.metrics().prefix_cache_window_evictions_total, 0);  // the pool did run short
  expect_drained(e);
}

// ---- Speculative decoding (engine/speculative.h) ----------------------------------------------

namespace {
struct SpecCase {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  int min_tokens = 0;
  int n = 1;
  std::vector<std::string> stop;
  SamplingParams sp;
};

// ≥ 100 requests: the test prompts, prompts that repeat themselves (drafts get accepted), counts,
// code; max_tokens from 1 to 20 (so it lands inside drafts), stop strings, min_tokens (a masked
// draft token is rejected), sampling with seeds and penalties, n = 2.
std::vector<SpecCase> spec_cases(const Tokenizer& tok) {
  static const char* kLines[] = {"the cat sat on the mat", "x = x + 1; y = y * 2;", "SELECT id FROM users WHERE age > 30",
                                 "roses are red, violets are blue", "for (int i = 0; i < n; ++i) sum += a[i];",
                                 "The meeting is at 10 am in room 4."};
  std::vector<std::string> texts(std::begin(kPrompts), std::end(kPrompts));
  for (int i = 0; i < 48; ++i) {
    const std::string line = kLines[i % 6];
    texts.push_back("Repeat this line " + std::to_string(2 + i % 3) + " times:\n" + line + "\n" + line + "\n" + (i % 2 ? line.substr(0, 8) : ""));
  }
  for (int k = 5; k < 25; ++k) {
    std::string t;
    for (int j = 1; j <= k; ++j) t += std::to_string(j) + ", ";
    texts.push_back(t);
  }
  for (int i = 0; i < 16; ++i)
    texts.push_back("def f" + std::to_string(i) + "(x):\n    return x * " + std::to_string(i) + "\n\ndef g" + std::to_string(i) +
                    "(x):\n    return x * ");
  std::vector<SpecCase> out;
  for (size_t i = 0; i < texts.size(); ++i) {
    SpecCase c;
    c.prompt = tok.encode(texts[i], true, true);
    c.max_tokens = 1 + static_cast<int>((i * 7) % 20);
    if (i % 3 == 2) c.min_tokens = c.max_tokens * 2 / 3;  // the end of text and stop strings held off (min_tokens)
    if (i % 7 == 0) c.stop = {","};
    if (i % 7 == 3) c.stop = {"\n", "x"};
    if (i % 4 == 1) {
      c.sp.temperature = 0.8f;
      c.sp.top_p = 0.9f;
      c.sp.seed = 77 + i;
      if (i % 8 == 1) c.sp.frequency_penalty = 0.5f;
    }
    if (i % 10 == 5) {
      c.n = 2;
      c.sp.temperature = 0.9f;
      c.sp.seed = 5 + i;
    }
    out.push_back(std::move(c));
  }
  return out;
}

// Every case at once in one engine (integrity checked after every step); the outcomes in order.
std::vector<Outcome> run_spec_cases(LlamaModel& m, const Tokenizer& tok, const EngineConfig& cfg, const std::vector<SpecCase>& cases,
                                    RequestParams::Spec choice, MetricsSnapshot* metrics = nullptr) {
  Engine e(m, tok, cfg);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const SpecCase& c : cases) {
    Request r;
    r.id = e.next_request_id();
    r.prompt = c.prompt;
    r.params.max_tokens = c.max_tokens;
    r.params.min_tokens = c.min_tokens;
    r.params.n = c.n;
    r.params.stop = c.stop;
    r.params.sampling = c.sp;
    r.params.spec_choice = choice;
    r.stream = std::make_shared<RequestStream>();
    Rejection rej = e.submit(r);
    EXPECT_EQ(rej.http_status, 0) << rej.message;
    streams.push_back(r.stream);
  }
  run_until_idle(e);
  expect_drained(e);
  if (metrics) *metrics = e.metrics();
  std::vector<Outcome> out;
  for (auto& s : streams) out.push_back(collect(*s));
  return out;
}

void expect_same_outcomes(const std::vector<Outcome>& want, const std::vector<Outcome>& got) {
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
    EXPECT_EQ(got[i].text, want[i].text) << "request " << i;
    EXPECT_EQ(got[i].finish, want[i].finish) << "request " << i;
    EXPECT_EQ(got[i].usage.completion_tokens, want[i].usage.completion_tokens) << "request " << i;
  }
}

EngineConfig with_spec(EngineConfig c, SpecConfig::Method method) {
  c.spec.method = method;
  c.spec.num_speculative_tokens = 4;
  c.spec.max_batch_tokens = 0;  // draft at every batch width, so verification runs mixed with everything
  c.spec.draft_cost = 0.f;      // and at full length whatever the acceptance so far
  return c;
}

void expect_spec_identical(LlamaModel& m, const Tokenizer& tok, EngineConfig base, size_t min_cases,
                           std::initializer_list<SpecConfig::Method> methods = {SpecConfig::Method::kNgram, SpecConfig::Method::kSuffix}) {
  const std::vector<SpecCase> cases = spec_cases(tok);
  ASSERT_GE(cases.size(), min_cases);
  base.spec.method = SpecConfig::Method::kNgram;  // a request's "speculative": false wins over it
  const std::vector<Outcome> want = run_spec_cases(m, tok, base, cases, RequestParams::Spec::kOff);
  for (auto method : methods) {
    MetricsSnapshot ms;
    const std::vector<Outcome> got = run_spec_cases(m, tok, with_spec(base, method), cases, RequestParams::Spec::kDefault, &ms);
    expect_same_outcomes(want, got);
    // Drafts ran, some were accepted and some rejected (rollbacks happened).
    EXPECT_GT(ms.spec_drafts_total, 20) << spec_method_name(method);
    EXPECT_GT(ms.spec_accepted_tokens_total, 0) << spec_method_name(method);
    EXPECT_LT(ms.spec_accepted_tokens_total, ms.spec_draft_tokens_total) << spec_method_name(method);
    std::printf("%s: %lld drafts, %lld of %lld draft tokens accepted\n", spec_method_name(method),
                static_cast<long long>(ms.spec_drafts_total), static_cast<long long>(ms.spec_accepted_tokens_total),
                static_cast<long long>(ms.spec_draft_tokens_total));
  }
}
}  // namespace

// Greedy and seeded sampling give the same tokens with and without speculation (the draws are
// the same draws), with stop strings, max_tokens inside a draft and n = 2; every page returns.
TEST(Engine, SpeculativeOutputIsIdenticalSmolLM2) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  expect_spec_identical(*m, *tok, small_config(1024), 100);
}

TEST(Engine, SpeculativeOutputIsIdenticalGemma3) {
  LlamaModel* m = kvtest::gemma3_model();
  ASSERT_NE(m, nullptr);
  auto tok = gemma3_tokenizer();
  ASSERT_NE(tok, nullptr);
  EngineConfig c = gemma_config();
  c.max_num_seqs = 32;
  c.max_model_len = 512;
  // ngram only: the suffix proposer is model-independent (SmolLM2's test covers it); Gemma's
  // 262k-entry output rows make every verified draft token expensive in CI.
  expect_spec_identical(*m, *tok, c, 100, {SpecConfig::Method::kNgram});
}

// Quantized pages are quantized when their last slot is written: drafts never write it, so a
// rejected draft never reaches a quantized page, and the output stays the same.
TEST(Engine, SpeculativeOutputIsIdenticalWithInt8Pages) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  EngineConfig c = small_config(1024);
  c.kv_dtype = KvDtype::kInt8;
  std::vector<SpecCase> cases = spec_cases(*tok);
  cases.resize(40);
  const std::vector<Outcome> want = run_spec_cases(*m, *tok, c, cases, RequestParams::Spec::kOff);
  MetricsSnapshot ms;
  expect_same_outcomes(want, run_spec_cases(*m, *tok, with_spec(c, SpecConfig::Method::kNgram), cases, RequestParams::Spec::kDefault, &ms));
  EXPECT_GT(ms.spec_accepted_tokens_total, 0);
}

// Under load the drafts stop: with max_batch_tokens 8 and 16 decoding sequences, no step drafts.
TEST(Engine, SpeculationTurnsOffWhenTheBatchIsWide) {
  LlamaModel* m = kvtest::smollm2_model();
  const Tokenizer* tok = smollm2_tokenizer();
  ASSERT_TRUE(m && tok);
  EngineConfig c = small_config(1024);
  c.spec.method = SpecConfig::Method::kNgram;
  c.spec.max_batch_tokens = 8;
  std::vector<SpecCase> cases;
  for (int i = 0; i < 16; ++i) {
    SpecCase sc;
    sc.prompt = tok->encode("Repeat this line 4 times:\nthe cat sat on the mat\nthe cat sat on the mat\nthe cat", true, true);
    sc.max_tokens = 24;
    cases.push_back(sc);
  }
  MetricsSnapshot wide, narrow;
  run_spec_cases(*m, *tok, c, cases, RequestParams::Spec::kDefault, &wide);
  cases.resize(1);
  run_spec_cases(*m, *tok, c, cases, RequestParams::Spec::kDefault, &narrow);
  EXPECT_GT(narrow.spec_accepted_tokens_total, 5);  // alone, the repeated line is drafted and accepted
  // Sixteen together: drafts only in the last steps, when most have finished (prefills end at
  // different steps); far fewer than sixteen times one sequence's.
  EXPECT_LT(wide.spec_draft_tokens_total, 4 * narrow.spec_draft_tokens_total);
}

// The Prometheus text: every sample line is `name value` with a number, every metric has its
// HELP and TYPE and at least one sample, whatever the HELP text's length (a fixed buffer once
// cut a long HELP, and the value line with it).
TEST(Metrics, EveryLineOfTheExpositionParses) {
  MetricsSnapshot m;
  m.prompt_tokens_total = 12345;
  m.tiers.resize(1);
  m.tiers[0].s.tier = "redis";
  const std::string text = render_prometheus(m);
  std::istringstream in(text);
  std::string line;
  std::map<std::string, int> samples;
  std::vector<std::string> typed;
  int n_help = 0;
  while (std::getline(in, line)) {
    ASSERT_FALSE(line.empty());
    if (line.rfind("# HELP ", 0) == 0) {
      ++n_help;
      continue;
    }
    if (line.rfind("# TYPE ", 0) == 0) {
      typed.push_back(line.substr(7, line.find(' ', 7) - 7));
      continue;
    }
    const size_t sp = line.rfind(' ');
    ASSERT_NE(sp, std::string::npos) << line;
    char* end = nullptr;
    const std::string value = line.substr(sp + 1);
    std::strtod(value.c_str(), &end);
    ASSERT_EQ(*end, '\0') << "not a number: " << line;
    std::string name = line.substr(0, std::min(sp, line.find('{')));
    for (const char* suffix : {"_bucket", "_sum", "_count"})
      if (name.size() > std::strlen(suffix) && name.compare(name.size() - std::strlen(suffix), std::string::npos, suffix) == 0 &&
          std::find(typed.begin(), typed.end(), name) == typed.end())
        name.resize(name.size() - std::strlen(suffix));
    ++samples[name];
  }
  EXPECT_EQ(n_help, static_cast<int>(typed.size()));
  EXPECT_GT(typed.size(), 30u);
  for (const std::string& t : typed) EXPECT_GT(samples[t], 0) << t << " has no sample";
  EXPECT_NE(text.find("kvserve:prompt_tokens_total 12345\n"), std::string::npos);
}
