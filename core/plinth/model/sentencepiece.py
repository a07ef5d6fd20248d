"""The SentencePiece BPE vocabulary a GGUF describes (``tokenizer.ggml.model == "llama"``), rebuilt on
the ``tokenizers`` library.

llama.cpp stores such a vocabulary as pieces, scores and token types, without merges: it encodes by
merging, again and again, the adjacent pair whose joined piece is in the vocabulary with the best
score, spells a space as "▁", and falls back to ``<0xNN>`` byte pieces for a character the vocabulary
lacks. A BPE model reproduces that once the merges are derived from the vocabulary itself: every way
to cut a piece into two pieces that also exist is a merge, ranked by the joined piece's score. This is
what transformers does when it reads such a GGUF, and plinth is checked against it token for token
(tests/core/model/test_gemma3_tokenizer.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4
SPACE = "\u2581"  # SentencePiece's spelling of a space
# architectures whose GGUF vocabulary is Gemma's: pieces of only spaces are written with real spaces,
# and the scores do not follow the merge order (the order of the pieces in the file does)
GEMMA_FAMILY = frozenset({"gemma", "gemma2", "gemma3"})


def gguf_sentencepiece_bpe(metadata: Mapping[str, Any], source: str = "") -> BackendTokenizer:
    """The SentencePiece BPE tokenizer of a GGUF whose ``tokenizer.ggml.model`` is ``"llama"``.

    :param metadata: the GGUF's metadata: ``tokenizer.ggml.tokens``, ``.scores``, ``.token_type``,
        ``.unknown_token_id``, ``.add_space_prefix`` (llama.cpp's default: True) and
        ``general.architecture`` (the Gemma family reads its vocabulary as :data:`GEMMA_FAMILY` says).
    :param source: the file, named in errors.
    :raises ValueError: the metadata lacks the tokens, or its scores or token types do not match them.
    """
    where = f" in {source}" if source else ""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"GGUF metadata has no tokenizer.ggml.tokens{where}")
    tokens = list(tokens)
    types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    gemma = str(metadata.get("general.architecture", "")) in GEMMA_FAMILY
    if gemma:
        # Gemma writes its pieces of 2+ spaces as "  ", but the text they match is spelled "▁▁"
        pieces = [SPACE * len(t) if " " in t and not t.strip(" ") else t for t in tokens]
        rank: Sequence[float] = range(0, -len(tokens), -1)  # earlier in the file merges first
    else:
        pieces = tokens
        rank = list(metadata.get("tokenizer.ggml.scores") or ())
    for name, values in (("token_type", types), ("scores", rank)):
        if len(values) != len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.{name} has {len(values)} entries for {len(tokens)} tokens{where}")
    vocab = {piece: i for i, piece in enumerate(pieces)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = pieces[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(pieces) else None
    bpe = models.BPE(
        vocab=vocab, merges=derive_merges(pieces, rank, vocab), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    backend = BackendTokenizer(bpe)
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # one pre-token for the whole text (no split): SentencePiece merges across word boundaries
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:  # the space the pre-tokenizer put in front of the text is not part of it
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    # control tokens (<bos>, <start_of_turn>, ...) match whole in text and decode(skip_special_tokens)
    # drops them; user-defined ones ("\n\n", "[multimodal]") match whole too but are ordinary text.
    # A user-defined piece respelled above ("  " -> "▁▁") is no longer in the text's spelling: the
    # merges produce it instead (as transformers does).
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
    )
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _USER_DEFINED and t in vocab
    ]
    if user:
        backend.add_tokens(user)
    return backend


def derive_merges(pieces: Sequence[str], rank: Sequence[float], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    Each piece that can be cut into two pieces of the vocabulary yields one merge per such cut. Merges
    are ordered by the joined piece's ``rank`` (higher first), then by the longer left part, then the
    longer right part; merges equal in all three keep the vocabulary's order. Ties are broken exactly
    so because the BPE then picks the merge transformers' conversion picks.

    :param pieces: the vocabulary's pieces, by id (a piece that occurs twice counts once, first place).
    :param rank: each piece's priority (its score, or minus its position); a repeated piece takes the
        rank of its last occurrence, as its id in ``vocab`` is the last.
    :param vocab: piece -> id.
    """
    ranks: dict[str, float] = {}
    for piece, score in zip(pieces, rank, strict=True):
        ranks[piece] = score
    found: list[tuple[float, int, int, str, str]] = []
    for piece, score in ranks.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-score, -cut, cut - len(piece), left, right))
    found.sort(key=lambda m: m[:3])  # stable: equal keys keep the vocabulary's order
    return [(m[3], m[4]) for m in found]
