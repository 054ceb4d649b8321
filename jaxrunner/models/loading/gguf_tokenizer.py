"""A GGUF file's tokenizer, built from its ``tokenizer.ggml.*`` metadata with the ``tokenizers`` library.

transformers' own GGUF route (``from_pretrained(..., gguf_file=...)``) reads the file through a
reader that imports torch, which is no run-time dependency of jaxrunner. The metadata already holds
everything a byte-level BPE tokenizer is made of (the vocabulary, the merges, the token types, the
special token ids, the chat template, whether to add BOS), so it is assembled here the way
transformers' GGUF converter assembles it, and the result encodes, decodes and formats chats the
same (``tests/test_gguf.py`` compares the two).

Byte-level BPE (``tokenizer.ggml.model = "gpt2"``) is what SmolLM2, Llama 3 and Qwen2 files use;
SentencePiece BPE (``"llama"``) what Llama 2 and Mistral files use. Other tokenizer models still
go through transformers, which then needs torch.
"""
from __future__ import annotations

import functools

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

# tokenizer.ggml.pre -> the split regex its merges were learned with (absent: GPT-2's own, built
# into ByteLevel). The entries of transformers' table for the architectures jaxrunner serves.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the spelling of every byte-level token)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _spelled(token: str, alphabet: set[str]) -> str:
    """A token in the byte alphabet, as the BPE model looks it up."""
    if set(token) <= alphabet:
        return token
    return "".join(_byte_alphabet()[b] for b in token.encode("utf-8"))


def byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int] | None,
                   pre: str | None, bos_id: int | None, add_bos: bool) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of a ``gpt2``-model GGUF vocabulary."""
    alphabet = set(_byte_alphabet().values())
    vocab = {_spelled(token, alphabet): index for index, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    split = _SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _set_bos(tok, tokens, bos_id, add_bos)
    types = token_types or []
    # Control tokens spelled outside the byte alphabet are llama.cpp mislabels: adding them would
    # grow the vocabulary past the model's (transformers skips them too).
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    return tok


def sentencepiece_bpe(tokens: list[str], scores: list[float] | None, merges: list[str] | None,
                      token_types: list[int] | None, bos_id: int | None, add_bos: bool) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of a ``llama``-model (SentencePiece BPE) GGUF vocabulary: pieces
    spelled with "▁" for spaces, bytes as ``<0xNN>`` tokens (byte fallback), a "▁" prepended to the
    first word. Without merges in the file they are derived from the scores, as transformers does."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores or [0.0] * len(tokens))))
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    _set_bos(tok, tokens, bos_id, add_bos)
    types = token_types or []
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-scored piece first (ties: the
    shorter left part first), the way transformers rebuilds SentencePiece merges."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _set_bos(tok: Tokenizer, tokens: list[str], bos_id: int | None, add_bos: bool) -> None:
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])


def wrap(tokenizer: Tokenizer, tokens: list[str], special_ids: dict[str, int | None],
         chat_template: str | None, add_bos: bool):
    """A transformers fast tokenizer around ``tokenizer`` (transformers' tokenizer classes need no torch)."""
    from transformers import PreTrainedTokenizerFast  # lazy: transformers is heavy; reading GGUF weights needs none

    specials = {name: tokens[i] for name, i in special_ids.items() if i is not None and 0 <= i < len(tokens)}
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)
    if chat_template:
        fast.chat_template = chat_template
    fast.add_bos_token = add_bos
    return fast
