// Hot and cold pages of live sequences (kv/cold_store.h): the spill file's round trip and its
// checks, and the real models reading cold pages back. The oracle is the same sequence with
// every page in RAM: Quest reads the same pages either way, so logits must be bit-identical,
// while the resident pages stay within the budget at every step.
#include <fcntl.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "engine/engine.h"
#include "engine/sequence_runner.h"
#include "kv/cold_store.h"
#include "model_fixture.h"

using namespace kv;

namespace {

EvictionConfig quest(int32_t sparse_pages, int64_t budget = 0, bool offload = false) {
  EvictionConfig c;
  c.sparse_pages = sparse_pages;
  c.budget = budget;
  c.offload_cold = offload;
  return c;
}

std::vector<int32_t> tokens_of(size_t n, uint32_t seed) {
  std::vector<int32_t> t(n);
  std::mt19937 rng(seed);
  for (auto& x : t) x = static_cast<int32_t>(1000 + rng() % 20000);
  return t;
}

// The spill file's descriptor, found the way an outside process would: /proc/self/fd, the one
// deleted file in dir (a directory of the test's own: another deleted /tmp file the process
// holds, e.g. a second test run's, was taken for it once).
int spill_fd(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (!ec && target.rfind(dir + "/", 0) == 0 && target.find("(deleted)") != std::string::npos) return std::stoi(e.path().filename());
  }
  return -1;
}

}  // namespace

// A page written down and read back into another pool page is byte-identical, key summaries
// included; a flipped byte in the file is caught by the checksum; slots are reused.
TEST(ColdPages, StoreRoundTripAndChecksum) {
  KvLayout l;
  l.n_layer = 3;
  l.n_head_kv = 2;
  l.head_dim = 64;
  l.block_size = 16;
  l.dtype = KvDtype::kF16;
  PagePool pool(l, 8);
  pool.enable_key_stats();
  std::vector<int32_t> pages;
  ASSERT_TRUE(pool.allocate(3, &pages));
  std::mt19937 rng(7);
  std::vector<float> k(l.n_head_kv * l.head_dim), v(k.size());
  for (int32_t layer = 0; layer < l.n_layer; ++layer)
    for (int32_t slot = 0; slot < l.block_size; ++slot) {
      for (auto& x : k) x = float(rng() % 2000) / 1000.f - 1.f;
      for (auto& x : v) x = float(rng() % 2000) / 1000.f - 1.f;
      ASSERT_TRUE(pool.write_token(layer, pages[0], slot, k.data(), v.data()));
    }
  char dir_template[] = "/tmp/kvserve-cold-test-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  auto store = ColdStore::create(dir, pool);
  ASSERT_TRUE(store) << store.message();
  ColdStore& cs = **store;
  const int32_t slot = cs.put(pages[0]);
  ASSERT_GE(slot, 0);
  ASSERT_TRUE(cs.get(slot, pages[1]));
  const int64_t bounds = key_stats_bytes_per_page(l);
  for (int32_t layer = 0; layer < l.n_layer; ++layer) {
    EXPECT_EQ(std::memcmp(pool.k_data(layer, pages[0]), pool.k_data(layer, pages[1]), l.k_layer_page_bytes(layer)), 0);
    EXPECT_EQ(std::memcmp(pool.v_data(layer, pages[0]), pool.v_data(layer, pages[1]), l.v_layer_page_bytes(layer)), 0);
    EXPECT_EQ(std::memcmp(pool.key_stats(layer, pages[0]), pool.key_stats(layer, pages[1]), bounds), 0);
    EXPECT_EQ(std::memcmp(cs.key_stats(slot, layer), pool.key_stats(layer, pages[0]), bounds), 0);
  }
  // A prefetched slot is served from RAM, the same bytes.
  cs.prefetch(slot);
  for (int i = 0; i < 200 && cs.stats().prefetches == 0; ++i) usleep(1000);
  ASSERT_TRUE(cs.get(slot, pages[2]));
  EXPECT_EQ(cs.stats().prefetch_hits, 1);
  EXPECT_EQ(std::memcmp(pool.k_data(1, pages[0]), pool.k_data(1, pages[2]), l.k_layer_page_bytes(1)), 0);
  // Corrupt one byte of the slot on disk: the read fails and is counted.
  const int fd = spill_fd(dir);
  ASSERT_GE(fd, 0);
  uint8_t b = 0;
  const off_t at = off_t(slot) * cs.slot_bytes() + 100;
  ASSERT_EQ(pread(fd, &b, 1, at), 1);
  b ^= 0x40;
  ASSERT_EQ(pwrite(fd, &b, 1, at), 1);
  EXPECT_FALSE(cs.get(slot, pages[1]));
  EXPECT_EQ(cs.stats().errors, 1);
  cs.release(slot);
  EXPECT_EQ(cs.slots_used(), 0);
  EXPECT_EQ(cs.put(pages[0]), slot);  // reused
  cs.release(slot);
  for (int32_t p : pages) pool.release(p);
  EXPECT_EQ(pool.n_used(), 0);
  std::filesystem::remove(dir);  // empty: the spill file was unlinked at once
}

// SmolLM2, one sequence of 1,000 tokens with a 256-token RAM budget: every logit equals the
// all-in-RAM run's (prompt beyond the budget and teacher-forced decoding), the resident tokens
// are back within the budget after every forward, pages come back from disk, a rollback into a
// cold page works, and everything is given back at the end.
TEST(ColdPages, SequenceRunnerLogitsEqualAllInRam) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  KvLayout l = m->kv_layout(16, KvDtype::kF16);
  ThreadPool tp(2);
  const std::vector<int32_t> toks = tokens_of(1000, 11);
  const int32_t n_prompt = 800, n_decode = 200;
  auto run = [&](bool offload, std::vector<float>* prompt_logits, ColdStats* stats) {
    // Room for what one step reads back: each of SmolLM2's 30 layers × 3 KV heads picks its own 6 pages.
    PagePool pool(l, 128);
    pool.enable_key_stats();
    std::unique_ptr<ColdStore> cold;
    if (offload) cold = std::move(*ColdStore::create("/tmp", pool));
    SequenceRunner seq(*m, pool, tp, 64);
    EXPECT_TRUE(seq.set_eviction(quest(6, 256, offload), cold.get()).is_ok());
    if (offload) {
      EXPECT_TRUE(seq.feed(toks.data(), n_prompt).is_ok());
    } else {  // the same runs: full chunks up to the budget, then Quest tiles of 8
      EXPECT_TRUE(seq.feed(toks.data(), 256, false).is_ok());
      seq.set_chunk(8);
      EXPECT_TRUE(seq.feed(toks.data() + 256, n_prompt - 256).is_ok());
      seq.set_chunk(64);
    }
    *prompt_logits = seq.logits();
    std::vector<float> out, all;
    for (int32_t i = n_prompt; i < n_prompt + n_decode; i += 20) {  // 20 positions a forward
      EXPECT_TRUE(seq.feed_all_logits(toks.data() + i, 20, &out).is_ok());
      all.insert(all.end(), out.begin(), out.end());
      if (offload) {
        EXPECT_LE(seq.kept_tokens(), 256) << "at " << i;
      }
    }
    // Roll back into a cold page (it will be written again: it must come back and lose its
    // slot), then feed 100 tokens from there in the same runs.
    const int64_t cut = 16 * 20 + 5;
    if (offload) {
      EXPECT_GT(seq.cold_pages(), 30);
      EXPECT_EQ(seq.table().pages[20], kColdPage);
    }
    EXPECT_TRUE(seq.truncate(cut));
    if (!offload) seq.set_chunk(8);
    EXPECT_TRUE(seq.feed(toks.data() + cut, 100).is_ok());
    all.insert(all.end(), seq.logits().begin(), seq.logits().end());
    if (!offload) seq.set_chunk(64);
    EXPECT_TRUE(seq.feed_all_logits(toks.data() + cut + 100, 20, &out).is_ok());
    all.insert(all.end(), out.begin(), out.end());
    if (offload) {
      EXPECT_LE(seq.kept_tokens(), 256);
      *stats = cold->stats();
    }
    seq.reset();
    EXPECT_EQ(pool.n_used(), 0);
    EXPECT_TRUE(pool.check_integrity().is_ok());
    if (cold) {
      EXPECT_EQ(cold->slots_used(), 0);
    }
    return all;
  };
  std::vector<float> p_ram, p_cold;
  ColdStats st;
  const std::vector<float> ram = run(false, &p_ram, &st), cold = run(true, &p_cold, &st);
  ASSERT_EQ(ram.size(), cold.size());
  EXPECT_EQ(std::memcmp(p_ram.data(), p_cold.data(), p_ram.size() * 4), 0);
  size_t diff = 0;
  for (size_t i = 0; i < ram.size(); ++i) diff += ram[i] != cold[i];
  EXPECT_EQ(diff, 0u);
  EXPECT_GT(st.pages_out, 30);
  EXPECT_GT(st.pages_in, 20);  // Quest picked cold pages and they came back
  EXPECT_EQ(st.errors, 0);
  EXPECT_EQ(st.no_room, 0);
}

// The engine (SmolLM2 and Gemma 3): greedy output with cold pages equals the all-in-RAM
// output, forks (n = 2) share cold slots, integrity (every slot reference a table's) holds
// after every step, and when the requests end no page and no slot is held. The prompts fit the
// budget and the answers go far past it: Quest reads a prompt whole, except with cold pages past
// the budget (Quest tiles, which would otherwise hold every page), where the two differ.
// cold_cache_bytes: the cold run's KV cache (default: cache_bytes).
MetricsSnapshot engine_matches(LlamaModel* m, const Tokenizer& tok, int32_t n_prompt, int64_t budget, int64_t cache_bytes,
                               int64_t cold_cache_bytes = 0) {
  auto run = [&](bool offload, MetricsSnapshot* ms) {
    EngineConfig c;
    c.max_num_batched_tokens = 8;
    c.max_num_seqs = 4;
    c.max_model_len = 2048;
    c.block_size = 16;
    c.kv_cache_bytes = offload && cold_cache_bytes > 0 ? cold_cache_bytes : cache_bytes;
    c.n_threads = 2;
    c.enable_prefix_caching = false;
    c.kv_policy = quest(4, budget, offload);
    Engine e(*m, tok, c);
    EXPECT_TRUE(e.init_status().is_ok()) << e.init_status().message();
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (int k = 0; k < 2; ++k) {
      Request r;
      r.id = e.next_request_id();
      r.prompt = tokens_of(n_prompt + 50 * k, 5 + k);
      r.params.max_tokens = 200;
      r.params.n = 2;
      r.params.ignore_eos = true;
      r.params.sampling.temperature = 0;
      r.stream = std::make_shared<RequestStream>();
      EXPECT_EQ(e.submit(r).http_status, 0);
      streams.push_back(r.stream);
    }
    for (int i = 0; i < 100000 && e.step(); ++i) {
      const Status st = e.check_integrity();
      EXPECT_TRUE(st.is_ok()) << st.message();
      if (!st) break;
    }
    EXPECT_EQ(e.pages_in_use(), 0);
    EXPECT_EQ(e.pool().n_used(), 0);
    *ms = e.metrics();
    std::vector<std::vector<int32_t>> out(4);
    for (int k = 0; k < 2; ++k) {
      std::vector<StreamEvent> evs;
      streams[k]->pop(&evs, std::chrono::milliseconds(0));
      for (const StreamEvent& ev : evs) {
        if (ev.kind == StreamEvent::kError) ADD_FAILURE() << ev.error;
        for (int32_t t : ev.tokens) out[k * 2 + ev.index].push_back(t);
      }
    }
    return out;
  };
  MetricsSnapshot m_ram, m_cold;
  const auto ram = run(false, &m_ram), cold = run(true, &m_cold);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(ram[i].size(), 200u);
    EXPECT_EQ(ram[i], cold[i]) << "sequence " << i;
  }
  EXPECT_TRUE(m_cold.has_cold);
  EXPECT_GT(m_cold.cold.pages_out, 0);
  EXPECT_GT(m_cold.cold.pages_in, 0);
  EXPECT_EQ(m_cold.cold.slots_used, 0);
  EXPECT_EQ(m_cold.cold.errors, 0);
  EXPECT_EQ(m_cold.cold.no_room, 0);
  return m_cold;
}

TEST(ColdPages, EngineSmolLM2OutputEqualsAllInRam) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  engine_matches(m, *kvtest::smollm2_tokenizer(), 60, 128, 64ll << 20);
}

// A pool that holds the four sequences' budgets but little more: fetches find no free page, and
// each sends down a page of its own sequence that the layer does not read instead of reading
// without the page it picked (which changed greedy text with the load). Same outputs as all in RAM.
TEST(ColdPages, EngineTightPoolSwapsPagesInsteadOfSkipping) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  const MetricsSnapshot ms = engine_matches(m, *kvtest::smollm2_tokenizer(), 60, 128, 64ll << 20, 14ll << 20);
  EXPECT_GT(ms.cold.room_swaps, 0);
}

TEST(ColdPages, EngineGemma3OutputEqualsAllInRam) {
  LlamaModel* m = kvtest::gemma3_model();
  ASSERT_TRUE(m);
  auto f = GgufFile::open(kvtest::gemma3_path());
  ASSERT_TRUE(f);
  auto tok = Tokenizer::from_gguf(**f);
  ASSERT_TRUE(tok);
  engine_matches(m, **tok, 60, 128, 96ll << 20);
}

// Bad configurations are refused with a message.
TEST(ColdPages, ConfigNeedsQuestAndRoom) {
  EvictionConfig c = quest(0, 512, true);
  EXPECT_FALSE(c.validate(16).is_ok());  // no Quest
  c = quest(8, 32, true);
  EXPECT_FALSE(c.validate(16).is_ok());  // budget below sink + recent + tail
  c = quest(8, 512, true);
  c.policy = EvictionPolicy::kH2O;
  EXPECT_FALSE(c.validate(16).is_ok());  // eviction and offload together
  EXPECT_TRUE(quest(8, 512, true).validate(16).is_ok());
}
