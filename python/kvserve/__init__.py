"""kvserve in Python: vLLM's offline API over the kvserve C++ engine, in this process.

    from kvserve import LLM, SamplingParams
    llm = LLM(model="models/SmolLM2-135M-Instruct.Q4_1.gguf", kv_cache_dtype="int8")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)

Requests go through the server's own request parser (as OpenAI request bodies), so defaults,
limits, seeds and error messages are the server's: the same seed gives the same text as
`kvserve serve`. See docs/python.md.
"""
from __future__ import annotations

import json
import operator
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _kvserve

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestError"]


class RequestError(ValueError):
    """A request the engine refused, with the server's message (what the HTTP API would answer).

    status: the HTTP status the server would send (400, 404, 429, 500, ...); type, param, code:
    the OpenAI error object's fields; index: which prompt of the call it was.
    """

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, index: int = -1):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.index = index


_kvserve.set_error_class(RequestError)


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: what a choice may say. Give one of json (a JSON schema, as
    a dict or its text), regex (the whole output matches it), choice (one of these strings),
    grammar (EBNF/GBNF, start rule `root`) or json_object=True (any JSON value).
    disable_any_whitespace: JSON without whitespace between its tokens. See docs/structured_output.md.
    """

    json: Optional[Union[str, Dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def _body(self) -> Dict[str, Any]:
        b: Dict[str, Any] = {}
        for name in ("json", "regex", "choice", "grammar", "json_object"):
            v = getattr(self, name)
            if v is not None:
                b[name] = list(v) if name == "choice" and not isinstance(v, str) else v
        if self.disable_any_whitespace:
            b["disable_any_whitespace"] = True
        return b


@dataclass
class SamplingParams:
    """vLLM's SamplingParams (the fields kvserve supports; others raise TypeError).

    temperature 0 is greedy. top_k 0 or -1 is off. seed None draws a fresh seed per request
    (or one from LLM(seed=...)). logprobs k: the chosen token's logprob and the top k.
    max_tokens None: up to the model's context (within what the KV cache holds). min_tokens: as
    vLLM's, no end of text, stop_token_ids or stop string before that many tokens (at most
    max_tokens). kv_eviction: a long-context KV policy, as the
    server's request field ({"policy": "snapkv", "budget": 2048}). cache_salt: the prefix
    cache namespace (requests of different salts never share pages). structured_outputs: a
    StructuredOutputsParams constraint (JSON schema, regex, choice, grammar). logit_bias: {token id:
    bias in [-100, 100]} added to the logits before the draw. prompt_logprobs k: each prompt
    token's logprob given the tokens before it, its rank and the top k (RequestOutput.prompt_logprobs;
    with max_tokens=0 the prompt is all that runs). include_stop_str_in_output: the stop string that
    ended a choice stays in its text. truncate_prompt_tokens k: a prompt keeps its last k tokens
    (-1: the last max_model_len).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    cache_salt: Optional[str] = None
    kv_eviction: Optional[Dict[str, Any]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    logit_bias: Optional[Dict[int, float]] = None

    def __post_init__(self) -> None:
        # JSON has no NaN or infinity: say which field, not what the request body could not hold.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, float) and not math.isfinite(v):
                raise RequestError(f"Invalid value for '{name}': {v} is not a finite number.", param=name,
                                   code="invalid_value")

    def _stops(self) -> List[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _body(self, chat: bool) -> Dict[str, Any]:
        """The OpenAI request fields these parameters mean (the prompt is added by the caller)."""
        b: Dict[str, Any] = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
        }
        if self.seed is not None:
            b["seed"] = self.seed
        if self.stop is not None:
            b["stop"] = self.stop
        if self.stop_token_ids:
            b["stop_token_ids"] = list(self.stop_token_ids)
        if self.include_stop_str_in_output:
            b["include_stop_str_in_output"] = True
        if self.skip_special_tokens is not True:
            b["skip_special_tokens"] = self.skip_special_tokens  # the server's parser checks the type
        if self.truncate_prompt_tokens is not None:
            b["truncate_prompt_tokens"] = self.truncate_prompt_tokens
        if self.max_tokens is not None:
            b["max_tokens"] = self.max_tokens
        if self.min_tokens != 0:  # checked by the server's parser (a range, an integer, at most max_tokens)
            b["min_tokens"] = self.min_tokens
        if self.logprobs is not None:
            if chat:
                b["logprobs"] = True
                b["top_logprobs"] = self.logprobs
            else:
                b["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            b["prompt_logprobs"] = self.prompt_logprobs
        if self.cache_salt is not None:
            b["cache_salt"] = self.cache_salt
        if self.kv_eviction is not None:
            b["kv_eviction"] = self.kv_eviction
        if self.logit_bias:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id to bias, not {type(self.logit_bias).__name__}")
            b["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError("structured_outputs must be a StructuredOutputsParams, not "
                                f"{type(self.structured_outputs).__name__}")
            b["structured_outputs"] = self.structured_outputs._body()
        return b


@dataclass
class Logprob:
    """One candidate token's log-probability (of the model's distribution, before penalties
    and temperature). rank: 1 for the most likely; None for a chosen token outside the top k."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Union[int, str, None] = None  # the stop string that ended it; None for EOS / length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: None for the first token, then {token id: Logprob} with the
    # prompt's token first (its rank in the distribution) and the top k, as vLLM's.
    prompt_logprobs: Optional[List[Optional[Dict[int, Logprob]]]] = None
    # kvserve's KV policy outcome (SamplingParams.kv_eviction), summed over the choices.
    kv_tokens_kept: int = 0
    kv_tokens_evicted: int = 0
    kv_tokens_reindexed: int = 0  # positions given back by re-indexing past max_model_len


class Tokenizer:
    """The model's own tokenizer (the engine's, read from the GGUF)."""

    def __init__(self, engine: Any):
        self._engine = engine

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        return self._engine.tokenize(text, _flag("add_special_tokens", add_special_tokens))

    def decode(self, token_ids: Union[int, Sequence[int]], skip_special_tokens: bool = False) -> str:
        # As HuggingFace's decode (vLLM's get_tokenizer()): special tokens kept unless asked; one id too.
        ids = _token_ids("decode()", [token_ids] if _is_int(token_ids) else token_ids)
        return self._engine.detokenize_bytes(ids, not _flag("skip_special_tokens", skip_special_tokens)).decode("utf-8", errors="replace")

    def apply_chat_template(self, conversation: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]],
                            tools: Optional[List[Dict[str, Any]]] = None, *, chat_template: Optional[str] = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> Union[str, List[int], List[str], List[List[int]]]:
        """As transformers' apply_chat_template: the conversation (or a list of them) rendered by the
        model's chat template (or `chat_template`: a Jinja template, a file, or a built-in name),
        as token ids (tokenize=True, the default there too) or as text. `tools` and extra keyword
        arguments are the template's variables (LLM.chat's chat_template_kwargs); it renders
        exactly what LLM.chat and the server's /v1/chat/completions would run."""
        unsupported = [k for k in ("documents", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                   "return_assistant_tokens_mask", "tokenizer_kwargs") if k in kwargs]
        if unsupported:
            raise TypeError(f"apply_chat_template: {', '.join(unsupported)} not supported here (kvserve renders one "
                            "conversation to text or token ids)")
        if not conversation:
            raise RequestError("'messages' must contain at least one message.", param="messages", code="empty_array")
        batched = not isinstance(conversation[0], dict)
        out = []
        for conv in (conversation if batched else [conversation]):
            body: Dict[str, Any] = {"messages": conv, "add_generation_prompt": add_generation_prompt}
            if continue_final_message:
                body["continue_final_message"] = True  # the last message left open, as transformers
            if tools is not None:
                body["tools"] = tools
            if kwargs:
                body["chat_template_kwargs"] = kwargs
            text, ids = self._engine.render_chat(_json(body), chat_template or "")
            out.append(ids if tokenize else text)
        return out if batched else out[0]


PromptType = Union[str, Dict[str, Any], List[int]]

_ENGINE_ARGS = {
    "kv_cache_dtype", "kv_cache_memory", "block_size", "enable_prefix_caching", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "max_n", "threads", "kv_cache_dtype_layers",
    "act_quant", "served_model_name", "quiet", "speculative_config", "chat_template", "past_trained_context",
    "jump_forward_tokens",
}



def _is_int(x: Any) -> bool:
    """An int, a NumPy integer, or anything else with __index__ (not a bool)."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
        return True
    except TypeError:
        return False


def _token_ids(where: str, ids: Any) -> List[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{where} takes a list of token ids, not {type(ids).__name__}")
    out = []
    for t in ids:
        if not _is_int(t):
            raise TypeError(f"{where} takes a list of token ids (ints), not a list holding {type(t).__name__}")
        out.append(operator.index(t))
    return out


def _flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} is a bool, not {type(v).__name__}")
    return v


def _jsonable(x: Any) -> Any:
    """NumPy scalars and arrays (and anything else with .tolist() / .item()) as JSON: vLLM takes
    them, and json.dumps said "Object of type int64 is not JSON serializable"."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"Object of type {type(x).__name__} is not JSON serializable")


def _json(body: Dict[str, Any]) -> str:
    return json.dumps(body, default=_jsonable)

class LLM:
    """An engine over one GGUF model, in this process (vLLM's LLM).

    model: path to a .gguf file. kv_cache_dtype: auto (f16), f32, f16, bf16, fp8 (fp8_e4m3),
    fp8_e5m2, int8, int4. kv_cache_memory: bytes (int), "2GiB", or a fraction of RAM ("0.25").
    enable_prefix_caching, max_num_seqs, max_num_batched_tokens, max_model_len, block_size:
    as vLLM's and as `kvserve serve`'s flags. seed: requests without a seed get seeds drawn
    from it (reproducible calls); None gives each request a fresh seed. threads: engine
    threads (default: the machine's cores). quiet: no loading lines on stderr.
    speculative_config: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 5} or
    {"method": "suffix"} (drafts from the text itself; outputs unchanged, docs/speculative.md).
    jump_forward_tokens: under structured outputs, the text the constraint forces next goes into
    one step as a draft of at most this many tokens (16; 0: off; outputs unchanged,
    docs/structured_output.md), as serve's --jump-forward-tokens.
    A max_model_len past the model's training context (the GGUF's context_length) prints one
    warning on stderr, as serve's --max-model-len; past_trained_context=True (serve's
    --past-trained-context) says it is meant and drops it.
    """

    def __init__(self, model: str, *, seed: Optional[int] = None, tokenizer: Optional[str] = None,
                 **kwargs: Any):
        unknown = set(kwargs) - _ENGINE_ARGS
        if unknown:
            raise TypeError(f"LLM() got unsupported arguments: {', '.join(sorted(unknown))} "
                            f"(kvserve takes: {', '.join(sorted(_ENGINE_ARGS | {'seed'}))})")
        if tokenizer is not None and tokenizer != model:
            raise TypeError("kvserve reads the tokenizer from the GGUF file: leave `tokenizer` unset")
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model is the path of a GGUF file, not {type(model).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed is an int or None, not {type(seed).__name__}")
        args = dict(kwargs)
        for key in ("kv_cache_memory",):
            if key in args and not isinstance(args[key], str):
                args[key] = str(args[key])
        for key in ("max_model_len", "threads"):
            if args.get(key) is None:
                args.pop(key, None)
        for key in ("kv_cache_dtype_layers", "act_quant", "served_model_name", "speculative_config", "chat_template"):
            if args.get(key) is None:
                args.pop(key, None)
        if isinstance(args.get("speculative_config"), dict):
            args["speculative_config"] = json.dumps(args["speculative_config"])
        self._engine = _kvserve.Engine(str(model), **args)
        self._pid = os.getpid()
        self._rng = random.Random(seed) if seed is not None else None
        self._next_id = 0

    # -- vLLM's entry points -------------------------------------------------------------
    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                 *, use_tqdm: bool = True) -> List[RequestOutput]:
        """Completes every prompt (str, {"prompt": str}, {"prompt_token_ids": [...]}), batched
        continuously; returns one RequestOutput per prompt, in order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_for(sampling_params, len(prompts))
        bodies, texts = [], []
        for p, sp in zip(prompts, params):
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    prompt: Any = list(p["prompt_token_ids"])
                elif "prompt" in p:
                    prompt = p["prompt"]
                else:
                    raise TypeError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            elif isinstance(p, (list, tuple)):
                prompt = list(p)
            elif isinstance(p, str):
                prompt = p
            else:
                raise TypeError(f"a prompt is a str, a list of token ids or a dict, not {type(p).__name__}")
            texts.append(prompt if isinstance(prompt, str) else None)
            body = self._sampling_body(sp, chat=False)
            if sp.max_tokens is None:
                # vLLM's None: up to the context. The server's default for completions is 16,
                # so the room is computed here, from the same tokenization the server does.
                ids = prompt if isinstance(prompt, list) else self._engine.tokenize(prompt, True)
                prompt = ids
                # Within what the KV cache holds for one sequence, unless a KV policy evicts (the
                # server's chat default, openai_request.cpp).
                limit = self._engine.max_model_len
                if (sp.kv_eviction or {}).get("policy", "none") == "none":
                    limit = min(limit, self._engine.kv_capacity_tokens)
                n_prompt = len(ids)  # what the server keeps of it (it computed 1 token for a truncated 1,200)
                if sp.truncate_prompt_tokens is not None and sp.truncate_prompt_tokens >= 0:
                    n_prompt = min(n_prompt, sp.truncate_prompt_tokens)
                body["max_tokens"] = max(1, limit - n_prompt)
            body["prompt"] = prompt
            bodies.append(_json(body))
        return self._run(bodies, params, texts, chat=False, use_tqdm=use_tqdm)

    def chat(self, messages: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]],
             sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
             *, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: Optional[str] = None, chat_template_kwargs: Optional[Dict[str, Any]] = None,
             tools: Optional[List[Dict[str, Any]]] = None,
             tool_choice: Optional[Union[str, Dict[str, Any]]] = None) -> List[RequestOutput]:
        """Answers one conversation (a list of {"role", "content"} messages) or a list of
        them, through the model's chat template (or `chat_template`: a Jinja template, a file,
        or a built-in name, chatml or gemma3); one RequestOutput per conversation.
        `chat_template_kwargs`: extra variables for the template, as vLLM's LLM.chat takes them.

        `tools` (OpenAI's list of {"type": "function", "function": {...}}) go to the template, as
        vLLM's LLM.chat passes them; the output is the generated text, not parsed into calls.
        `tool_choice` (a kvserve extra): {"type": "function", "function": {"name": ...}} or
        "required" constrain that text as the server does (the call's arguments JSON, or the
        array of {"name", "parameters"}); default "none"."""
        if not messages:  # the server answers 400 for "messages": [] (a batch of none is refused too)
            raise RequestError("'messages' must contain at least one message.", param="messages",
                               code="empty_array", index=0)
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        params = self._params_for(sampling_params, len(convs))
        bodies = []
        for conv, sp in zip(convs, params):
            body = self._sampling_body(sp, chat=True)
            body["messages"] = conv
            body["add_generation_prompt"] = add_generation_prompt
            if chat_template_kwargs is not None:
                body["chat_template_kwargs"] = chat_template_kwargs
            if tools is not None:
                body["tools"] = tools
            if tool_choice is not None or tools is not None:
                body["tool_choice"] = "none" if tool_choice is None else tool_choice
            bodies.append(_json(body))
        return self._run(bodies, params, [None] * len(convs), chat=True, use_tqdm=use_tqdm,
                         chat_template=chat_template or "")

    def get_tokenizer(self) -> Tokenizer:
        return Tokenizer(self._engine)

    # -- kvserve extras --------------------------------------------------------------------
    def kv_stats(self) -> Dict[str, int]:
        """pages_in_use (held by requests), pages_cached (prefix cache only), pages_total, block_size."""
        return self._engine.stats()

    def check_integrity(self) -> None:
        """Raises RuntimeError unless the KV pool's refcounts match the block tables."""
        self._engine.check_integrity()

    def close(self) -> None:
        """Stops the engine and frees the KV cache (also done when the LLM is collected)."""
        self._engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    @staticmethod
    def _params_for(sp: Optional[Union[SamplingParams, Sequence[SamplingParams]]], n: int) -> List[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if isinstance(sp, (dict, str)):
            raise TypeError(f"sampling_params is a SamplingParams or a list of them, not {type(sp).__name__}")
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"{len(sp)} sampling_params for {n} prompts: give one, or one per prompt")
        for x in sp:
            if not isinstance(x, SamplingParams):
                raise TypeError(f"sampling_params is a SamplingParams or a list of them, not a list holding {type(x).__name__}")
        return sp

    def _sampling_body(self, sp: SamplingParams, chat: bool) -> Dict[str, Any]:
        body = sp._body(chat)
        body["model"] = self._engine.model_name
        if sp.seed is None and self._rng is not None:
            body["seed"] = self._rng.randrange(1 << 63)
        return body

    def _run(self, bodies: List[str], params: List[SamplingParams], texts: List[Optional[str]],
             chat: bool, use_tqdm: bool, chat_template: str = "") -> List[RequestOutput]:
        if os.getpid() != self._pid:
            # A forked child has the engine's memory but not its threads: a call waited forever.
            raise RuntimeError("this LLM was created in another process (the parent of a fork): create the LLM in "
                               "this process (multiprocessing's 'spawn' start method does)")
        bar = None
        if use_tqdm and bodies:
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(bodies), desc="Processed prompts", unit="prompt", dynamic_ncols=True)
            except ImportError:
                bar = None
        try:
            raw = self._engine.generate(bodies, chat, bar.update if bar is not None else None, chat_template)
        finally:
            if bar is not None:
                bar.close()
        outs = []
        for i, (r, sp) in enumerate(zip(raw, params)):
            prompt = texts[i]
            if prompt is None:  # chat or token ids: the text the model saw, special tokens included
                prompt = self._decode(r["prompt_token_ids"], special=True)
            outs.append(RequestOutput(
                request_id=str(self._next_id), prompt=prompt, prompt_token_ids=list(r["prompt_token_ids"]),
                outputs=[self._completion(c, sp) for c in r["choices"]], finished=True,
                num_cached_tokens=r["cached_tokens"], prompt_logprobs=self._prompt_logprobs(r),
                kv_tokens_kept=r["kv_tokens_kept"],
                kv_tokens_evicted=r["kv_tokens_evicted"], kv_tokens_reindexed=r["kv_tokens_reindexed"]))
            self._next_id += 1
        return outs

    def _decode(self, ids: Sequence[int], special: bool = False) -> str:
        return self._engine.detokenize_bytes(list(ids), special).decode("utf-8", errors="replace")

    def _prompt_logprobs(self, r: Dict[str, Any]) -> Optional[List[Optional[Dict[int, Logprob]]]]:
        if r["prompt_logprobs"] is None:
            return None
        out: List[Optional[Dict[int, Logprob]]] = [None]
        for tok, lp, rank, top in r["prompt_logprobs"]:
            entry: Dict[int, Logprob] = {tok: Logprob(lp, rank, self._token_text(tok))}
            for k, (tid, tlp) in enumerate(top, start=1):
                if tid != tok:
                    entry[tid] = Logprob(tlp, k, self._token_text(tid))
            out.append(entry)
        return out

    def _completion(self, c: Dict[str, Any], sp: SamplingParams) -> CompletionOutput:
        text = c["text"].decode("utf-8", errors="replace")
        token_ids = list(c["token_ids"])
        logprobs = None
        cumulative = None
        if c["logprobs"] is not None:
            logprobs, cumulative = [], 0.0
            for tok, lp, top in c["logprobs"]:
                entry: Dict[int, Logprob] = {}
                for rank, (tid, tlp) in enumerate(top, start=1):
                    entry[tid] = Logprob(tlp, rank, self._token_text(tid))
                if tok not in entry:
                    entry[tok] = Logprob(lp, None, self._token_text(tok))
                # The chosen token first, as vLLM orders it.
                entry = {tok: entry[tok], **{k: v for k, v in entry.items() if k != tok}}
                logprobs.append(entry)
                cumulative += lp
        # vLLM's stop_reason, as the engine saw it: the stop string matched, or the stop token's id
        return CompletionOutput(index=c["index"], text=text, token_ids=token_ids, cumulative_logprob=cumulative,
                                logprobs=logprobs, finish_reason=c["finish_reason"], stop_reason=c["stop_reason"])

    def _token_text(self, tid: int) -> str:
        return self._engine.token_bytes(tid).decode("utf-8", errors="replace")
