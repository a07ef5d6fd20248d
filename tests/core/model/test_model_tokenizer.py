"""plinth.model.tokenizer: the GGUF-built tokenizer of the default model, HF folders, chat templates and
the incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from plinth.model.loader import load_tokenizer, resolve_model
from plinth.model.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    InvalidText,
    Tokenizer,
    find_lone_surrogate,
)

# ids from transformers' AutoTokenizer.from_pretrained(dir, gguf_file=...) (checked live: slow test)
EXPECTED_IDS = {
    "Hello world": [19556, 905],
    "12345 678": [33, 34, 35, 36, 37, 216, 38, 39, 40],
    "  a  b\n\n\tc": [216, 253, 216, 278, 1116, 197, 83],
    "héllo 你好 🎉": [88, 2756, 31394, 216, 18645, 250, 48392, 138, 15107, 232, 227],
    "def f(x):\n    return x**2": [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
}
TEXTS = [
    *EXPECTED_IDS,
    "12345 678 3.14159 1,000,000",
    "  a  b\n\n\tc   \n",
    "héllo 你好 🎉 naïve café Ωμέγα",
    "def f(x):\n    return x**2  # square\n",
    "I'm can't we'll THEY'RE",
    "",
    " ",
    "\n\n\n",
    "emoji 👨\u200d👩\u200d👧\u200d👦 flags 🇫🇷",
    "tabs\t\tand    spaces",
    "<|endoftext|>text<repo_name>",
]
MESSAGES = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    try:
        return load_tokenizer(resolve_model(None))
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_default_gguf_token_ids(smol: Tokenizer) -> None:
    for text, ids in EXPECTED_IDS.items():
        assert smol.encode(text) == ids, text
        assert smol.decode(ids, skip_special_tokens=False) == text
    assert smol.decode(EXPECTED_IDS["<|im_start|>user\nhi<|im_end|>"]) == "user\nhi"
    assert (smol.bos_token_id, smol.eos_token_ids) == (1, [2])
    assert smol.vocab_size == 49152


def test_default_chat_template(smol: Tokenizer) -> None:
    text = smol.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not smol.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


@pytest.mark.slow
def test_default_gguf_tokenizer_matches_transformers(smol: Tokenizer) -> None:
    from transformers import AutoTokenizer

    source = resolve_model(None)
    hf = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    for text in TEXTS:
        for special in (True, False):
            ids = smol.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert smol.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    for gen in (True, False):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert smol.apply_chat_template(MESSAGES, add_generation_prompt=gen) == expected


# -- Hugging Face folders and templates ------------------------------------------------------------


def _hf_folder(tmp_path: Path, smol: Tokenizer, **tok_cfg: Any) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    smol.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return folder


def test_hf_folder_special_tokens_and_template(tmp_path: Path, smol: Tokenizer) -> None:
    folder = _hf_folder(
        tmp_path,
        smol,
        bos_token="<|im_start|>",
        eos_token={"content": "<|im_end|>"},
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}",
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_folder(folder)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2, 0]
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"
    (folder / "chat_template.jinja").write_text("{{ messages | length }}{{ messages[0] | tojson }}")
    assert Tokenizer.from_hf_folder(folder).apply_chat_template([{"a": "é"}]) == '1{"a": "é"}'


def test_add_bos_token_from_tokenizer_config(tmp_path: Path, smol: Tokenizer) -> None:
    tok = Tokenizer.from_hf_folder(_hf_folder(tmp_path, smol, bos_token="<|endoftext|>", add_bos_token=True))
    assert tok.encode("Hello world") == [0, 19556, 905]
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_no_chat_template_is_a_clear_error(tmp_path: Path, smol: Tokenizer) -> None:
    tok = Tokenizer.from_hf_folder(_hf_folder(tmp_path, smol))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_raise_exception_and_sandbox(smol: Tokenizer) -> None:
    tok = Tokenizer(smol.backend, chat_template="{{ raise_exception('only user turns: ' + messages[0].role) }}")
    with pytest.raises(ChatTemplateError, match="only user turns: system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    unsafe = Tokenizer(smol.backend, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        unsafe.apply_chat_template([])


def test_unsupported_gguf_tokenizer_model() -> None:
    with pytest.raises(ValueError, match="'rwkv' in x.gguf is not supported; supported: 'gpt2'.*'llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv"}, source="x.gguf")


def test_gguf_tokens_outside_the_byte_alphabet_are_respelled() -> None:
    # llama.cpp writes some tokens with raw characters (a space, a newline); the BPE vocabulary spells
    # them in GPT-2's byte alphabet, as transformers does ("Ġ" is the space byte, "Ċ" the newline)
    tokens = ["a", "b", "ab", "a b", "\n", "<|im_start|>"]
    tok = Tokenizer.from_gguf_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3],
            "tokenizer.ggml.merges": ["a b"],
        }
    )
    assert [tok.token_to_id(t) for t in ("a", "b", "ab", "aĠb", "Ċ")] == [0, 1, 2, 3, 4]
    assert tok.token_to_id("a b") is None and tok.token_to_id("\n") is None
    assert tok.encode("ab<|im_start|>", add_special_tokens=False) == [2, 5]


# -- incremental detokenizer -----------------------------------------------------------------------


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) == detok.text
    assert detok.output_ids == ids
    return deltas


def test_detokenizer_holds_split_characters(smol: Tokenizer) -> None:
    text = " 你好 🎉 naïve 👨\u200d👩\u200d👧 done"
    ids = smol.encode(text)
    deltas = _stream(smol, smol.encode("Say:"), ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some emoji bytes arrived before their character was complete


def test_detokenizer_special_tokens_and_prompt_context(smol: Tokenizer) -> None:
    prompt = smol.encode("<|im_start|>assistant\n")
    ids = smol.encode(" Paris is nice.<|im_end|>")
    assert "".join(_stream(smol, prompt, ids)) == " Paris is nice."
    assert "".join(_stream(smol, prompt, ids, skip=False)) == " Paris is nice.<|im_end|>"


def test_detokenizer_truncate_and_flush(smol: Tokenizer) -> None:
    detok = IncrementalDetokenizer(smol, [])
    detok.step(smol.encode("Hello world"))
    detok.truncate(5)
    assert detok.text == "Hello"
    emoji = smol.encode("🎉")
    detok = IncrementalDetokenizer(smol, [])
    assert detok.step(emoji[:-1]) == ""
    assert detok.flush() == "\ufffd"  # an incomplete character at the very end is shown, once


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40))
def test_detokenizer_stream_equals_decode(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text, add_special_tokens=False)
    # SmolLM2's vocabulary lacks a few bytes (0xF1, 0x04, ...): text using them cannot round-trip
    assume(smol.decode(ids) == text)
    deltas = _stream(smol, [], ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


# -- invalid text, token bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["\ud800", "ok \udfff", "a\ud83d b"])
def test_lone_surrogate_is_invalid_text_naming_where(smol: Tokenizer, text: str) -> None:
    with pytest.raises(InvalidText, match=r"lone surrogate \(U\+D[89A-F][0-9A-F]{2}\) at character \d"):
        smol.encode(text)
    assert find_lone_surrogate(text) == next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    assert find_lone_surrogate("😀 a surrogate pair in UTF-16, one character here") is None


def test_encode_rejects_non_strings(smol: Tokenizer) -> None:
    with pytest.raises(TypeError, match="must be a str, not bytes"):
        smol.encode(b"Hi")  # type: ignore[arg-type]


def test_long_text_encodes_and_decodes_the_same_through_the_gil_free_path(smol: Tokenizer) -> None:
    text = "héllo 世界 🎉 " * 8000  # > _RELEASE_GIL_AT characters: the batch call
    ids = smol.encode(text)
    assert ids == smol.backend.encode(text).ids
    assert len(ids) > 1 << 16 and smol.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text, add_special_tokens=False)
    assert b"".join(smol.token_bytes(i) for i in ids) == text.encode()


def test_token_string_shows_partial_characters_as_openai_does(smol: Tokenizer) -> None:
    ids = smol.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # split over tokens: each holds part of the 4 bytes
    strings = [smol.token_string(i) for i in ids]
    assert all("\ufffd" not in s for s in strings)
    assert "".join(strings).startswith("\\xf0\\x9f")
    assert smol.token_string(smol.encode("Hello", add_special_tokens=False)[0]) == "Hello"
    assert smol.token_bytes(1) == b"<|im_start|>"


def test_token_bytes_of_sentencepiece_pieces() -> None:
    vocab = {"<unk>": 0, "\u2581Hi": 1, "<0xE4>": 2, "<0xB8>": 3, "<0x96>": 4}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok = Tokenizer(backend)
    assert tok.token_bytes(1) == b" Hi"
    assert b"".join(tok.token_bytes(i) for i in (2, 3, 4)).decode() == "世"
    assert tok.token_string(2) == "\\xe4"
