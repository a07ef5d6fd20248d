"""Tokenizer, chat template and incremental detokenizer, on top of the ``tokenizers`` library.

A :class:`Tokenizer` comes from a Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json``)
or from a GGUF file's metadata, which stores the vocabulary, merges and special tokens under
llama.cpp's key names (rebuilt here as the byte-level BPE they describe, or as SentencePiece BPE by
:mod:`plinth.model.sentencepiece`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from plinth.model.chat_templates import GEMMA_END_OF_TURN, builtin_chat_template
from plinth.model.sentencepiece import GEMMA_FAMILY, gguf_sentencepiece_bpe

if TYPE_CHECKING:
    import jinja2

# llama.cpp token types (tokenizer.ggml.token_type)
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with (None: GPT-2's own regex)
_GGUF_SPLITS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# pre-tokenizers that split every digit on its own before the GPT-2 regex (llama.cpp's "\p{N}" rule)
_GGUF_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
# Llama 3's tokenizer.json matches whole words against the vocabulary before merging
_GGUF_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"}


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed (including ``raise_exception``)."""


class InvalidText(ValueError):
    """Text the tokenizer cannot take: it holds a lone UTF-16 surrogate (``"\\ud800"``), which is no
    Unicode character (JSON's ``\\ud800`` escape and Python strings allow it, UTF-8 does not)."""


_SURROGATE = re.compile("[\ud800-\udfff]")
# above this many characters (ids), encode (decode) goes through the batch call, which releases the
# GIL: a 7 MB prompt otherwise holds it for ~17 s, freezing every other thread (the server's event loop)
_RELEASE_GIL_AT = 1 << 16
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def find_lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text``, or None when it is valid Unicode."""
    if text.isascii():
        return None
    m = _SURROGATE.search(text)
    return m.start() if m else None


def check_text(text: str) -> str:
    """``text`` itself; :class:`InvalidText` when it holds a lone surrogate."""
    i = find_lone_surrogate(text)
    if i is not None:
        raise InvalidText(
            f"the text holds a lone surrogate (U+{ord(text[i]):04X}) at character {i}, which is not valid "
            "Unicode; send UTF-8 text (in JSON, a \\uD800-\\uDFFF escape must be half of a pair)"
        )
    return text


# -- chat templates ----------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' templates expect json.dumps semantics (not jinja's HTML-escaping tojson)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """A chat template compiled in a sandbox, with the helpers Hugging Face templates use."""
    # jinja2 is imported here, not at module level: plain generation (the cold-start path) never needs it
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# -- tokenizer ---------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids, special token ids and the chat template of one model.

    :param backend: the ``tokenizers.Tokenizer`` doing the work.
    :param bos_token_id: beginning-of-sequence id, or None.
    :param eos_token_ids: every id that ends generation (first: the tokenizer's own EOS).
    :param chat_template: the jinja2 chat template source, or None.
    :param add_bos: prepend ``bos_token_id`` in :meth:`encode` when the backend's post-processor
        does not already do it.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos: bool = False,
        name: str = "",
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self.name = name
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._prepend_bos = (
            add_bos
            and bos_token_id is not None
            and backend.encode("a", add_special_tokens=True).ids[:1] != [bos_token_id]
        )

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """Read ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json`` and ``config.json`` from a Hugging Face folder."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} has no tokenizer.json; plinth reads fast-tokenizer files only "
                "(save one with transformers: AutoTokenizer.from_pretrained(...).save_pretrained(folder))"
            )
        backend = BackendTokenizer.from_file(str(path))
        tok_cfg = _json_or_empty(folder / "tokenizer_config.json")
        special = {**_json_or_empty(folder / "special_tokens_map.json"), **tok_cfg}
        model_cfg = _json_or_empty(folder / "config.json")
        gen_cfg = _json_or_empty(folder / "generation_config.json")

        def token_id(key: str) -> int | None:
            token = special.get(key)
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos = token_id("bos_token")
        if bos is None:
            bos = model_cfg.get("bos_token_id")
        eos: list[int] = []
        for value in (token_id("eos_token"), gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
            eos.extend(_ids(value))
        template_file = folder / "chat_template.jinja"
        template = tok_cfg.get("chat_template")
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        elif isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            chat_template=template if isinstance(template, str) else None,
            add_bos=bool(tok_cfg.get("add_bos_token", False)),
            name=str(folder),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str = "") -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes from its ``tokenizer.ggml.*`` keys.

        ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from the vocabulary, merges, token types and
        pre-tokenizer name. ``"llama"``: SentencePiece BPE from the pieces, scores and token types
        (:mod:`plinth.model.sentencepiece`). A Gemma-family file (``general.architecture`` gemma,
        gemma2 or gemma3) also ends generation at ``<end_of_turn>``, and gets plinth's Gemma chat
        template when it carries none (:data:`plinth.model.chat_templates.GEMMA_TEMPLATE`).
        """
        kind = metadata.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend = _gguf_byte_level_bpe(metadata)
        elif kind == "llama":
            backend = gguf_sentencepiece_bpe(metadata, source)
        else:
            raise ValueError(
                f"GGUF tokenizer model {kind!r}{' in ' + source if source else ''} is not supported; "
                "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE). "
                "Use the model's Hugging Face folder instead."
            )
        eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in metadata]
        architecture = str(metadata.get("general.architecture", ""))
        end_of_turn = backend.token_to_id(GEMMA_END_OF_TURN) if architecture in GEMMA_FAMILY else None
        if end_of_turn is not None:  # Gemma's chat turns end with <end_of_turn>, not <eos> (as llama.cpp's EOT)
            eos.append(end_of_turn)
        template = metadata.get("tokenizer.chat_template") or builtin_chat_template(architecture)
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
        return cls(
            backend,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(e) for e in eos],
            chat_template=template,
            add_bos=bool(add_bos),
            name=source,
        )

    # -- text <-> ids ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS etc. as the model expects.

        :raises InvalidText: ``text`` holds a lone surrogate.
        :raises TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"the text to tokenize must be a str, not {type(text).__name__}")
        try:
            if len(text) > _RELEASE_GIL_AT:
                ids: list[int] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            else:
                ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the backend's only complaint about a str: it is not valid Unicode
            check_text(text)
            raise
        if add_special_tokens and self._prepend_bos:
            assert self.bos_token_id is not None
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 sequences decode to U+FFFD."""
        ids = list(ids)
        if len(ids) > _RELEASE_GIL_AT:
            return str(self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0])
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for, also when they are part of a UTF-8 character
        (an emoji or CJK character split over tokens, where :meth:`decode` gives U+FFFD)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            inverse = _byte_alphabet_inverse()
            if all(c in inverse for c in piece):
                return bytes(inverse[c] for c in piece)
            return piece.encode("utf-8")  # an added token written as text (one with a space, say)
        m = _BYTE_TOKEN.fullmatch(piece)  # SentencePiece byte fallback: <0xE2>
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_string(self, token_id: int) -> str:
        """The token as the OpenAI API shows it: its text, with the bytes that are no whole UTF-8
        character written as ``\\xNN`` (``"\\xf0\\x9f\\x98"`` for the first 3 bytes of an emoji)."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of an id, or None."""
        return self.backend.id_to_token(token_id)

    def _token_str(self, token_id: int | None) -> str:
        return (self.backend.id_to_token(token_id) or "") if token_id is not None else ""

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's chat template.

        :param add_generation_prompt: end with the header of an assistant turn.
        :param kwargs: extra template variables (``tools``, ``documents``, ...).
        :raises ChatTemplateError: the model has no template, or the template rejects the input.
        """
        if not self.chat_template:
            raise ChatTemplateError(
                f"the model{' ' + self.name if self.name else ''} has no chat template "
                "(tokenizer_config.json 'chat_template', chat_template.jinja, "
                "or GGUF tokenizer.chat_template); "
                "send a plain prompt instead"
            )
        context = {
            "bos_token": self._token_str(self.bos_token_id),
            "eos_token": self._token_str(self.eos_token_ids[0] if self.eos_token_ids else None),
            **kwargs,
        }
        import jinja2

        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


# -- incremental detokenization ------------------------------------------------------------------------

_PROMPT_CONTEXT = 6  # prompt tokens kept as context, so the first output token decodes with its spacing


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, for streaming.

    Decodes a short window of ids twice per step (the already-emitted part and the whole window) and
    emits the difference; while the window ends in an incomplete UTF-8 sequence (U+FFFD) nothing is
    emitted, so a multi-byte character split across tokens appears whole, once.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.output_ids: list[int] = []
        self.text = ""
        self._window: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0  # window[prefix:read] is context already turned into text
        self._read = len(self._window)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_ids: Iterable[int]) -> str:
        """Append ``new_ids``; return the text they complete ("" while a character is incomplete)."""
        new = list(new_ids)
        self.output_ids.extend(new)
        self._window.extend(new)
        prefix_text = self._decode(self._window[self._prefix : self._read])
        full_text = self._decode(self._window[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.text += delta
        self._prefix, self._read = self._read, len(self._window)
        if self._prefix > 4 * _PROMPT_CONTEXT:  # drop ids no later decode looks at
            del self._window[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete trailing sequence decodes to U+FFFD)."""
        prefix_text = self._decode(self._window[self._prefix : self._read])
        full_text = self._decode(self._window[self._prefix :])
        delta = full_text[len(prefix_text) :]
        self.text += delta
        self._prefix = self._read = len(self._window)
        return delta

    def truncate(self, num_chars: int) -> None:
        """Cut :attr:`text` to its first ``num_chars`` characters (a stop string was found)."""
        self.text = self.text[:num_chars]


# -- helpers -----------------------------------------------------------------------------------------


def _json_or_empty(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def _byte_alphabet_inverse() -> dict[str, int]:
    """Printable character -> byte: the inverse of :func:`_byte_alphabet`."""
    return {c: b for b, c in _byte_alphabet().items()}


@lru_cache(maxsize=1)
def _outside_alphabet() -> re.Pattern[str]:
    """Finds a character outside the byte alphabet (one C-level scan per token, not a set per token)."""
    return re.compile("[^" + "".join(re.escape(c) for c in _byte_alphabet().values()) + "]")


def _gguf_byte_level_bpe(metadata: Mapping[str, Any]) -> BackendTokenizer:
    """The byte-level BPE a GGUF's ``tokenizer.ggml.*`` keys describe."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    outside = _outside_alphabet().search
    # a token written with characters outside the byte alphabet is respelled in it (as transformers does)
    vocab = {
        "".join(alphabet[b] for b in tok.encode("utf-8")) if outside(tok) else tok: i for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _GGUF_IGNORE_MERGES)
    backend = BackendTokenizer(bpe)
    split = _GGUF_SPLITS.get(pre)
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(False, use_regex=False),
            ]
        )
    elif pre in _GGUF_DIGIT_SPLIT:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False, use_regex=True)]
        )
    else:  # GPT-2's regex, as transformers uses for pre-tokenizer names it does not know
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # control tokens (<|im_start|>, ...) match whole and are skipped by decode(skip_special_tokens);
    # a "control" token outside the byte alphabet is a llama.cpp mislabel and is left alone
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _GGUF_CONTROL and set(t) <= spelled
    ]
    backend.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _GGUF_USER_DEFINED and t in vocab
    ]
    if user:
        backend.add_tokens(user)
    return backend
