#include "server/openai_response.h"

#include <random>

#include "server/api_error.h"
#include "server/openai_request.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace kv {

using json = nlohmann::ordered_json;

namespace {

json byte_list(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

// Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}
json chat_logprobs(const std::vector<TokenLogprob>& lps, const Tokenizer& tok) {
  return {{"content", logprob_content(lps, tok)}, {"refusal", nullptr}};
}

// Completions (legacy): {"tokens", "token_logprobs", "top_logprobs": [{tok: lp}], "text_offset"}.
struct CompletionLogprobs {
  json tokens = json::array(), token_lps = json::array(), tops = json::array(), offsets = json::array();

  // An entry; null: a token nothing predicts (an echoed prompt's first: null logprob and top).
  // text: the token's text in the choice's text (default: its bytes without control tokens').
  void add(int32_t token, const TokenLogprob* lp, TextOffset* offset, const Tokenizer& tok, const std::string* text = nullptr) {
    const std::string s = logprob_token_string(tok.token_bytes(token, /*special=*/true));
    tokens.push_back(s);
    if (lp) {
      token_lps.push_back(lp->logprob);
      json top = json::object();
      for (const auto& [id, l] : lp->top) top[logprob_token_string(tok.token_bytes(id, /*special=*/true))] = l;
      // The chosen token is always there ("up to logprobs+1 elements", OpenAI; vLLM): with
      // logprobs=0 alone, and when it was sampled from outside the top k.
      if (!top.contains(s)) top[s] = lp->logprob;
      tops.push_back(top);
    } else {
      token_lps.push_back(nullptr);
      tops.push_back(nullptr);
    }
    offsets.push_back(offset->chars);
    offset->add(text ? *text : tok.token_bytes(token));  // generated text skips control tokens: they move no offset
  }
  json done() { return {{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}}; }
};

// echo: the prompt's tokens come first, as OpenAI and vLLM show them.
json completion_logprobs(const std::vector<TokenLogprob>& lps, TextOffset* offset, const Tokenizer& tok, const PromptResult* echo = nullptr) {
  CompletionLogprobs out;
  if (echo && !echo->ids.empty()) {
    // The echoed text has a prompt's control tokens where the client wrote them (token ids: all
    // of them; text: those it spelled, not a BOS the tokenizer added): they count where they are.
    size_t at = 0;  // bytes of echo->text passed
    auto text_of = [&](int32_t id) {
      std::string b = tok.token_bytes(id);
      if (b.empty()) {
        std::string spelled = tok.token_bytes(id, /*special=*/true);
        if (echo->text.compare(at, spelled.size(), spelled) == 0) b = std::move(spelled);
      }
      at += b.size();
      return b;
    };
    std::string t = text_of(echo->ids[0]);
    out.add(echo->ids[0], nullptr, offset, tok, &t);
    for (const auto& lp : echo->logprobs) {
      t = text_of(lp.token);
      out.add(lp.token, &lp, offset, tok, &t);
    }
  }
  for (const auto& lp : lps) out.add(lp.token, &lp, offset, tok);
  return out.done();
}

json chunk_base(const ResponseMeta& m) {
  json j = {{"id", m.id}, {"object", m.chat ? "chat.completion.chunk" : "text_completion"}, {"created", m.created}, {"model", m.model}};
  return j;
}

json with_choice(const ResponseMeta& m, json choice) {
  json j = chunk_base(m);
  j["choices"] = json::array({std::move(choice)});
  if (m.include_usage) j["usage"] = nullptr;
  return j;
}

}  // namespace

// Tokens are spelled with control tokens as their text ("<|im_end|>"), as vLLM and llama-server
// do: rendered empty, several at one position would collide in a completions top_logprobs dict.
json logprob_content(const std::vector<TokenLogprob>& lps, const Tokenizer& tok) {
  json content = json::array();
  for (const auto& lp : lps) {
    std::string s = tok.token_bytes(lp.token, /*special=*/true);
    json top = json::array();
    for (const auto& [id, l] : lp.top) {
      std::string ts = tok.token_bytes(id, /*special=*/true);
      top.push_back({{"token", ts}, {"logprob", l}, {"bytes", byte_list(ts)}});
    }
    content.push_back({{"token", s}, {"logprob", lp.logprob}, {"bytes", byte_list(s)}, {"top_logprobs", top}});
  }
  return content;
}

void TextOffset::add(const std::string& bytes) {
  // Characters as Python's decode(errors="replace") counts them (an ill-formed part is one U+FFFD);
  // an incomplete character at the end waits for the next token's bytes.
  tail += bytes;
  size_t i = 0;
  while (i < tail.size()) {
    const utf8::Step st = utf8::next(tail, i);
    if (st.kind == utf8::Kind::kIncomplete) break;
    ++chars;
    i += st.n;
  }
  tail.erase(0, i);
}

std::string logprob_token_string(const std::string& bytes) {
  if (utf8::is_valid(bytes)) return bytes;
  static const char* kHex = "0123456789abcdef";
  std::string out = "bytes:";
  for (unsigned char b : bytes) out += std::string("\\x") + kHex[b >> 4] + kHex[b & 15];
  return out;
}

json usage_json(const Usage& u) {
  json j = {{"prompt_tokens", u.prompt_tokens},
            {"completion_tokens", u.completion_tokens},
            {"total_tokens", u.prompt_tokens + u.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
  if (u.kv_policy != "none")  // a long-context KV policy ran: what it kept and evicted
    j["kv_eviction"] = {{"policy", u.kv_policy}, {"tokens_kept", u.kv_tokens_kept}, {"tokens_evicted", u.kv_tokens_evicted},
                        {"positions_reindexed", u.kv_tokens_reindexed}};
  return j;
}

json prompt_logprobs_json(const PromptResult& p, const Tokenizer& tok) {
  json out = json::array();
  if (p.ids.empty()) return out;
  out.push_back(nullptr);  // nothing predicts the first token
  auto entry = [&](double lp, json rank, int32_t id) {
    return json{{"logprob", lp}, {"rank", std::move(rank)}, {"decoded_token", tok.decode({id}, /*special=*/true)}};
  };
  for (const TokenLogprob& lp : p.logprobs) {
    json e = json::object();
    e[std::to_string(lp.token)] = entry(lp.logprob, lp.rank > 0 ? json(lp.rank) : json(nullptr), lp.token);
    for (size_t k = 0; k < lp.top.size(); ++k)
      if (lp.top[k].first != lp.token) e[std::to_string(lp.top[k].first)] = entry(lp.top[k].second, json(k + 1), lp.top[k].first);
    out.push_back(std::move(e));
  }
  return out;
}

json full_response(const ResponseMeta& meta, const std::vector<ChoiceResult>& choices, const std::vector<PromptResult>& prompts,
                   const Usage& usage, bool with_logprobs, const Tokenizer& tok) {
  json arr = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceResult& c = choices[i];
    const PromptResult* p = (meta.echo || meta.prompt_logprobs) && c.prompt < static_cast<int32_t>(prompts.size()) ? &prompts[c.prompt] : nullptr;
    json lp = nullptr;
    if (with_logprobs) {
      TextOffset offset;
      lp = meta.chat ? chat_logprobs(c.logprobs, tok) : completion_logprobs(c.logprobs, &offset, tok, meta.echo ? p : nullptr);
    }
    json finish = c.finish_reason.empty() ? json(nullptr) : json(c.finish_reason);
    if (meta.chat) {
      arr.push_back({{"index", i},
                     {"message", c.message ? *c.message : json{{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}}},
                     {"logprobs", lp},
                     {"finish_reason", finish},
                     {"stop_reason", stop_reason_json(c.stop_string, c.stop_token)}});
    } else {
      arr.push_back({{"index", i},
                     {"text", meta.echo && p ? p->text + c.text : c.text},
                     {"logprobs", lp},
                     {"finish_reason", finish},
                     {"stop_reason", stop_reason_json(c.stop_string, c.stop_token)}});
      if (meta.prompt_logprobs) arr.back()["prompt_logprobs"] = p ? prompt_logprobs_json(*p, tok) : json(nullptr);
    }
  }
  json j = {{"id", meta.id},
            {"object", meta.chat ? "chat.completion" : "text_completion"},
            {"created", meta.created},
            {"model", meta.model},
            {"choices", arr},
            {"usage", usage_json(usage)}};
  // vLLM puts a chat's prompt logprobs beside its choices (one conversation, one prompt).
  if (meta.chat && meta.prompt_logprobs) j["prompt_logprobs"] = prompts.empty() ? json(nullptr) : prompt_logprobs_json(prompts[0], tok);
  return j;
}

json chat_role_chunk(const ResponseMeta& meta, int32_t index) {
  return with_choice(meta, {{"index", index},
                            {"delta", {{"role", "assistant"}, {"content", ""}}},
                            {"logprobs", nullptr},
                            {"finish_reason", nullptr}});
}

json text_chunk(const ResponseMeta& meta, int32_t index, const std::string& text, const std::vector<TokenLogprob>* logprobs,
                TextOffset* text_offset, const Tokenizer& tok) {
  json lp = nullptr;
  if (logprobs) lp = meta.chat ? chat_logprobs(*logprobs, tok) : completion_logprobs(*logprobs, text_offset, tok);
  if (meta.chat)
    return with_choice(meta, {{"index", index}, {"delta", {{"content", text}}}, {"logprobs", lp}, {"finish_reason", nullptr}});
  return with_choice(meta, {{"index", index}, {"text", text}, {"logprobs", lp}, {"finish_reason", nullptr}});
}

json delta_chunk(const ResponseMeta& meta, int32_t index, json delta, const std::vector<TokenLogprob>* logprobs, const Tokenizer& tok) {
  return with_choice(meta, {{"index", index},
                            {"delta", std::move(delta)},
                            {"logprobs", logprobs ? chat_logprobs(*logprobs, tok) : json(nullptr)},
                            {"finish_reason", nullptr}});
}

json prompt_chunk(const ResponseMeta& meta, int32_t index, const PromptResult& p, bool with_logprobs, TextOffset* text_offset,
                  const Tokenizer& tok) {
  json j;
  if (meta.chat) {
    j = with_choice(meta, {{"index", index}, {"delta", {{"content", ""}}}, {"logprobs", nullptr}, {"finish_reason", nullptr}});
    if (meta.prompt_logprobs) j["prompt_logprobs"] = prompt_logprobs_json(p, tok);
    return j;
  }
  json lp = nullptr;
  if (meta.echo && with_logprobs) lp = completion_logprobs({}, text_offset, tok, &p);
  j = with_choice(meta, {{"index", index}, {"text", meta.echo ? p.text : ""}, {"logprobs", lp}, {"finish_reason", nullptr}});
  if (meta.prompt_logprobs) j["choices"][0]["prompt_logprobs"] = prompt_logprobs_json(p, tok);
  return j;
}

json stop_reason_json(const std::string& stop_string, int32_t stop_token) {
  if (!stop_string.empty()) return stop_string;
  return stop_token >= 0 ? json(stop_token) : json(nullptr);
}

json finish_chunk(const ResponseMeta& meta, int32_t index, const std::string& reason, const json& stop_reason) {
  if (meta.chat)
    return with_choice(meta, {{"index", index}, {"delta", json::object()}, {"logprobs", nullptr}, {"finish_reason", reason},
                              {"stop_reason", stop_reason}});
  return with_choice(meta, {{"index", index}, {"text", ""}, {"logprobs", nullptr}, {"finish_reason", reason}, {"stop_reason", stop_reason}});
}

json running_usage(const ResponseMeta& meta, int64_t completion_tokens) {
  return {{"prompt_tokens", meta.prompt_tokens}, {"completion_tokens", completion_tokens},
          {"total_tokens", meta.prompt_tokens + completion_tokens}};
}

json usage_chunk(const ResponseMeta& meta, const Usage& usage) {
  json j = chunk_base(meta);
  j["choices"] = json::array();
  j["usage"] = usage_json(usage);
  return j;
}

std::string sse_event(const json& j) { return "data: " + dump_json(j) + "\n\n"; }

std::string make_response_id(bool chat) {
  static const char* kHex = "0123456789abcdef";
  uint64_t a = random_seed(), b = random_seed();
  std::string id = chat ? "chatcmpl-" : "cmpl-";
  for (int i = 0; i < 16; ++i) id += kHex[(a >> (4 * i)) & 15];
  for (int i = 0; i < 16; ++i) id += kHex[(b >> (4 * i)) & 15];
  return id;
}

}  // namespace kv
