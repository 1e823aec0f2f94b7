#include "server/sse_writers.h"

#include <algorithm>

namespace kv {

using json = nlohmann::ordered_json;

const PromptResult* take_prompt(std::vector<PromptResult>& prompts, int32_t n_per_prompt, StreamEvent& ev) {
  const size_t k = static_cast<size_t>(ev.index / n_per_prompt);
  if (k >= prompts.size()) return nullptr;
  prompts[k].logprobs = std::move(ev.logprobs);
  return &prompts[k];
}

std::string ChatSseWriter::chunk(json j) const {
  if (meta.continuous_usage) j["usage"] = running_usage(meta, completion_tokens);
  return sse_event(j);
}

std::string ChatSseWriter::begin() {
  std::string out;
  if (meta.chat)
    for (int32_t i = 0; i < n; ++i) out += chunk(chat_role_chunk(meta, i));
  // echo without logprobs: the prompts' text at once (with them, when their logprobs come)
  if (meta.echo && !prompt_lp_events)
    for (int32_t i = 0; i < n; ++i) out += chunk(prompt_chunk(meta, i, prompts.at(i / n_per_prompt), false, &text_offset[i], *tok));
  return out;
}

std::string ChatSseWriter::event(StreamEvent& ev) {
  if (ev.index < 0 || ev.index >= n) return "";
  std::string out;
  if (ev.kind == StreamEvent::kText && !tools.empty()) {
    // The text becomes tool-call or content deltas, or is held (tool_calls.h); its
    // logprobs go with the first chunk it makes, or alone.
    completion_tokens += static_cast<int64_t>(ev.tokens.size());
    const std::vector<TokenLogprob>* lps = with_logprobs && !ev.logprobs.empty() ? &ev.logprobs : nullptr;
    std::vector<json> deltas = tools[ev.index].push(ev.text);
    if (deltas.empty() && lps) deltas.push_back(json::object());
    for (json& d : deltas) {
      out += chunk(delta_chunk(meta, ev.index, std::move(d), lps, *tok));
      lps = nullptr;
    }
  } else if (ev.kind == StreamEvent::kText) {
    completion_tokens += static_cast<int64_t>(ev.tokens.size());
    if (!meta.chat)  // completions: the end-of-text token too, as the whole response
      for (auto& lp : ev.eog_logprobs) ev.logprobs.push_back(std::move(lp));
    if (ev.text.empty() && ev.logprobs.empty()) return "";
    out = chunk(text_chunk(meta, ev.index, ev.text, with_logprobs ? &ev.logprobs : nullptr, &text_offset[ev.index], *tok));
  } else if (ev.kind == StreamEvent::kPrompt) {
    const int32_t first = ev.index;  // its prompt's first choice
    const PromptResult* p = take_prompt(prompts, n_per_prompt, ev);
    if (!p) return "";
    for (int32_t i = first; i < first + n_per_prompt; ++i) out += chunk(prompt_chunk(meta, i, *p, with_logprobs, &text_offset[i], *tok));
  } else if (ev.kind == StreamEvent::kFinish) {
    finish_reasons[ev.index] = ev.finish_reason;
    std::string reason = ev.finish_reason;
    if (!tools.empty() && reason != "abort")  // held text, parsed calls; the reason the response reports
      for (json& d : tools[ev.index].finish(&reason)) out += chunk(delta_chunk(meta, ev.index, std::move(d), nullptr, *tok));
    out += chunk(finish_chunk(meta, ev.index, reason, stop_reason_json(ev.stop_string, ev.stop_token)));
  } else {
    out = sse_event(from_event(ev).to_json());
  }
  return out;
}

std::string ChatSseWriter::end(const std::optional<ApiError>& ended, const Usage& usage) {
  std::string out;
  if (ended && std::any_of(finish_reasons.begin(), finish_reasons.end(), [](const std::string& r) { return r == "abort"; }))
    out += sse_event(ended->to_json());
  if (meta.include_usage) out += sse_event(usage_chunk(meta, usage));
  return out + kSseDone;
}

ResponsesSseWriter::ResponsesSseWriter(std::unique_ptr<ResponseBuilder> b, bool logprobs, std::function<bool(const ResponseBuilder&)> on_done)
    : builder_(std::move(b)), logprobs_(logprobs), on_done_(std::move(on_done)) {}

std::string ResponsesSseWriter::begin() { return responses_sse(builder_->begin()); }

std::string ResponsesSseWriter::event(StreamEvent& ev) {
  if (ev.index != 0 || failed_) return "";
  if (ev.kind == StreamEvent::kText) return responses_sse(builder_->push(ev.text, logprobs_ ? ev.logprobs : std::vector<TokenLogprob>{}));
  if (ev.kind == StreamEvent::kFinish) {
    finish_reason_ = ev.finish_reason;
    return "";
  }
  if (ev.kind == StreamEvent::kPrompt) return "";
  failed_ = true;
  return responses_sse(builder_->fail(from_event(ev)));
}

std::string ResponsesSseWriter::end(const std::optional<ApiError>& ended, const Usage& usage) {
  if (failed_) return "";
  // A failed response is kept too, as OpenAI keeps it (GET shows it failed).
  if (finish_reason_ == "abort" || finish_reason_.empty())
    return last_events(builder_->fail(ended ? *ended : ApiError{500, "The response ended without finishing.", "server_error", "", ""}, &usage));
  return last_events(builder_->finish(finish_reason_, usage));
}

std::string ResponsesSseWriter::last_events(std::vector<json> events) {
  if (on_done_ && !on_done_(*builder_) && !events.empty() && events.back().contains("response")) {
    builder_->set_store(false);
    events.back()["response"]["store"] = false;
  }
  return responses_sse(events);
}

}  // namespace kv
