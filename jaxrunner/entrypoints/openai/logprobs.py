"""OpenAI's logprobs shapes from the engine's per-token logprob dicts: the completions form (tokens,
token_logprobs, top_logprobs), the chat form (content entries with bytes and top_logprobs), and
vLLM's ``prompt_logprobs`` (per prompt token: None for the first, else {token id: logprob, rank,
decoded token})."""
from __future__ import annotations


def _logprob(value) -> float:
    return float(getattr(value, "logprob", value))  # a float, or a Logprob object


def _steps(logprobs, token_ids, tokenizer):
    """Per generated token: (its text, its logprob, [(text, logprob) of the top ones])."""
    for token_id, entries in zip(token_ids, logprobs or []):
        top = [(tokenizer.decode([int(t)]), _logprob(v)) for t, v in entries.items()]
        yield tokenizer.decode([int(token_id)]), _logprob(entries[token_id]), top


def completion_logprobs(logprobs, k: int | None, tokenizer, token_ids=None):
    if k is None or logprobs is None:
        return None
    token_ids = token_ids if token_ids is not None else [next(iter(e)) for e in logprobs]
    steps = list(_steps(logprobs, token_ids, tokenizer))
    return {"tokens": [s[0] for s in steps], "token_logprobs": [s[1] for s in steps],
            "top_logprobs": [dict(s[2][:k]) for s in steps], "text_offset": []}


def chat_logprobs(logprobs, k: int | None, tokenizer, token_ids=None):
    if k is None or logprobs is None:
        return None
    token_ids = token_ids if token_ids is not None else [next(iter(e)) for e in logprobs]
    return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top[:k]]}
                        for text, lp, top in _steps(logprobs, token_ids, tokenizer)]}


def prompt_logprobs_json(prompt_logprobs, tokenizer):
    """vLLM's ``prompt_logprobs`` field of a choice (None when the request asked for none)."""
    if prompt_logprobs is None:
        return None
    return [None if entries is None else
            {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": tokenizer.decode([int(t)])}
             for t, v in entries.items()}
            for entries in prompt_logprobs]


def echo_completion_logprobs(prompt_token_ids, prompt_logprobs, k: int, tokenizer) -> dict:
    """The completions form for the echoed prompt: its first token has no logprob (nothing precedes it)."""
    tokens = [tokenizer.decode([int(t)]) for t in prompt_token_ids]
    values, tops = [], []
    for token, entries in zip(prompt_token_ids, prompt_logprobs):
        values.append(None if entries is None else _logprob(entries[token]))
        tops.append(None if entries is None else
                    {tokenizer.decode([int(t)]): _logprob(v) for t, v in list(entries.items())[:k + 1]})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": []}


def joined(first: dict | None, second: dict | None) -> dict | None:
    """Two completions-form logprobs one after the other (echoed prompt, then the completion)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}
