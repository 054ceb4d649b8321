"""OpenAI's logprobs shapes from the engine's per-token logprob dicts: the completions form (tokens,
token_logprobs, top_logprobs) and the chat form (content entries with bytes and top_logprobs)."""
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
