"""Text <-> token ids: a `tokenizers.Tokenizer` built from a tokenizer.json folder or from GGUF metadata.

The GGUF path rebuilds what llama.cpp runs: byte-level BPE ("gpt2") with the pre-tokenizer regexes
llama.cpp picks per `tokenizer.ggml.pre`, or SentencePiece BPE ("llama") with merges recovered
from the token scores and byte fallback through <0xNN> tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tileinfer.engine.errors import InvalidRequestError, ModelLoadError
from tileinfer.engine.text.chat_template import render_chat_template
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

# Names of the special tokens that transformers hands to a chat template (its special_tokens_map).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Tokens that end an assistant turn in the chat formats we know; generation stops on them too.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
# GGUF token types (llama.cpp's llama_token_type).
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
_SPM_SPACE = "\u2581"
_SPM_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# How many times fewer characters these normalizers may leave of a text (NFC and NFKC compose at most four
# code points into one); others give no bound on a text's tokens (Tokenizer.fewest_tokens).
_SHRINK_BY_NORMALIZER = {"Prepend": 1, "NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4}
# pre-tokenizers that keep every character (unless their behavior is "removed")
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


_UNICODE_TO_BYTE = {char: byte for byte, char in _byte_to_unicode().items()}

# Pre-tokenizer regexes per llama.cpp pre-type (llama-vocab.cpp). Several regexes split in turn,
# each keeping the unmatched stretches as pieces too ("isolated").
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# written with escapes: several of these characters change under Unicode normalization when copied
_CJK_RUNS = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_PUNCTUATION = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_SPLITS_BY_PRE_TYPE: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), (_LLAMA3,)
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (_QWEN2,)),
    "qwen35": (_QWEN35,),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), (_GPT2,)),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"), (r"\p{N}", _GPT2)
    ),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "deepseek-llm": (
        "[\r\n]",
        _DEEPSEEK_LLM_LETTERS,
        _DEEPSEEK_LLM_PUNCTUATION,
        r"\s+$",
        _CJK_RUNS,
        r"\p{N}+",
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_RUNS, r"\p{N}"),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
}
# Pre-types whose whole pre-token is looked up in the vocabulary before merging (llama.cpp ignore_merges).
_IGNORE_MERGES_PRE_TYPES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"})
SUPPORTED_GGUF_TOKENIZERS = ("gpt2 (byte-level BPE)", "llama (SentencePiece BPE)")


@dataclass
class _Specials:
    """Special token facts gathered from config files or GGUF metadata."""

    named: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... -> token text
    add_bos_token: bool | None = None  # None: whatever the tokenizer.json post-processor does
    add_eos_token: bool | None = None
    extra_eos_ids: set[int] = field(default_factory=set)


class Tokenizer:
    """One model's tokenizer: encode, decode, raw token bytes, and its chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str | None, specials: _Specials) -> None:
        self._backend = backend
        self.chat_template = chat_template
        # One more than the largest id it maps: the ids a model may emit (a model's embedding may have
        # padding rows beyond them). Counting entries would miss ids past a hole or a repeated spelling.
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        self._special_tokens = dict(specials.named)  # passed to chat templates, as transformers does
        self.bos_token = self._special_tokens.get("bos_token")
        self.eos_token = self._special_tokens.get("eos_token")
        self.bos_token_id = self._token_id(self.bos_token)
        eos_token_id = self._token_id(self.eos_token)
        self._special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )
        end_of_turn_ids = {self._token_id(token) for token in _END_OF_TURN_TOKENS}
        self.eos_token_ids = frozenset(
            token_id
            for token_id in {eos_token_id, *end_of_turn_ids, *specials.extra_eos_ids}
            if token_id is not None and 0 <= token_id < self.vocab_size
        )
        probe = backend.encode("a", add_special_tokens=True).ids  # what the post-processor adds
        post_adds_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        post_adds_eos = eos_token_id is not None and probe[-1:] == [eos_token_id]
        add_bos = post_adds_bos if specials.add_bos_token is None else specials.add_bos_token
        add_eos = post_adds_eos if specials.add_eos_token is None else specials.add_eos_token
        self.add_bos_token = add_bos and self.bos_token_id is not None
        self._eos_to_append = eos_token_id if add_eos else None
        # strips_leading_space: decode() drops the space SentencePiece put before the first word
        description = json.loads(backend.to_str())
        self._decoder_kind, self.strips_leading_space = _decoder_kind(description.get("decoder"))
        # a token stands for at most its spelling's length of the normalized text (a byte-level token's
        # characters are bytes); None: no bound (fewest_tokens)
        shrink = _text_shrink(description)
        self._chars_per_token = None if shrink is None else shrink * max(map(len, vocab), default=1)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        """A Hugging Face tokenizer folder: tokenizer.json plus its config files."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"no tokenizer.json in {folder} (only tokenizer.json tokenizers are supported)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises plain Exception on a malformed file
            raise ModelLoadError(f"cannot read {tokenizer_file}: {error}") from error
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation_config = _read_json(folder / "generation_config.json")

        specials = _Specials()
        for name in _NAMED_SPECIAL_TOKENS:
            token = _token_text(config.get(name, special_map.get(name)))
            if token is not None:
                specials.named[name] = token
        if "add_bos_token" in config:
            specials.add_bos_token = bool(config["add_bos_token"])
        if "add_eos_token" in config:
            specials.add_eos_token = bool(config["add_eos_token"])
        generation_eos = generation_config.get("eos_token_id")
        if generation_eos is not None:
            specials.extra_eos_ids = set(
                generation_eos if isinstance(generation_eos, list) else [generation_eos]
            )
        return cls(backend, _folder_chat_template(folder, config), specials)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata."""
        metadata = _GgufMetadata(reader)
        model_type = metadata.get("tokenizer.ggml.model")
        tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        pre_type = metadata.get("tokenizer.ggml.pre") or "default"

        if len(token_types) != len(tokens):
            raise ModelLoadError(
                "GGUF tokenizer metadata is corrupt: token types and tokens differ in length"
            )
        try:
            if model_type == "gpt2":
                backend = _byte_level_backend(tokens, metadata.get("tokenizer.ggml.merges") or [], pre_type)
                default_add_bos = pre_type in _IGNORE_MERGES_PRE_TYPES  # llama.cpp's default for Llama 3
            elif model_type == "llama":
                scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
                unknown_id = metadata.get("tokenizer.ggml.unknown_token_id")
                add_space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
                backend = _sentencepiece_backend(tokens, scores, token_types, unknown_id, add_space_prefix)
                default_add_bos = True
            else:
                supported = ", ".join(SUPPORTED_GGUF_TOKENIZERS)
                raise ModelLoadError(f"unsupported GGUF tokenizer {model_type!r}; supported: {supported}")
        except ModelLoadError:
            raise
        except Exception as error:  # tokenizers raises plain Exception on inconsistent vocab or merges
            raise ModelLoadError(f"GGUF tokenizer metadata is corrupt: {error}") from error
        _add_gguf_special_tokens(backend, tokens, token_types)

        specials = _Specials()
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        ):
            token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
            if token_id is not None and 0 <= token_id < len(tokens):
                specials.named[name] = tokens[token_id]
        specials.add_bos_token = metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)
        specials.add_eos_token = metadata.get("tokenizer.ggml.add_eos_token", False)
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if (token_id := metadata.get(key)) is not None:
                specials.extra_eos_ids.add(token_id)
        return cls(backend, metadata.get("tokenizer.chat_template"), specials)

    # ---- text <-> ids -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids. The work runs without the GIL (encode_batch_fast; encode holds it), so a
        long text tokenized on a worker thread leaves the caller's event loop running."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to tokenize must be a string, not {type(text).__name__}")
        token_ids = self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if add_special_tokens:
            if self.add_bos_token:
                token_ids.insert(0, self.bos_token_id)
            if self._eos_to_append is not None:
                token_ids.append(self._eos_to_append)
        return token_ids

    def fewest_tokens(self, text: str) -> int:
        """At most len(encode(text)), found without tokenizing (a prompt too long for any context is refused
        at once); 0 for a tokenizer whose normalizer, pre-tokenizer or model may drop or fuse text."""
        if self._chars_per_token is None:
            return 0
        return -(-len(text) // self._chars_per_token)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        token_ids = list(token_ids)
        for token_id in token_ids:
            self._check_id(token_id)
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for; a multi-byte character may be split across tokens."""
        self._check_id(token_id)
        token = self._backend.id_to_token(token_id)
        if token is None:  # a hole in the ids: no text, as decode() gives it
            return b""
        if self._decoder_kind == "byte_level":
            # characters outside GPT-2's byte alphabet (in added tokens) stand for themselves
            return b"".join(
                bytes((_UNICODE_TO_BYTE[char],)) if char in _UNICODE_TO_BYTE else char.encode()
                for char in token
            )
        if self._decoder_kind == "sentencepiece":
            if byte_match := _SPM_BYTE_TOKEN.match(token):
                return bytes((int(byte_match.group(1), 16),))
            return token.replace(_SPM_SPACE, " ").encode()
        return self._backend.decode([token_id], skip_special_tokens=False).encode()

    def to_json(self) -> str:
        """The tokenizer as Hugging Face's tokenizer.json text."""
        return self._backend.to_str()

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def single_token_id(self, text: str) -> int | None:
        """The id of the token whose text is `text`, where one is (an added token such as <tool_call>)."""
        return self._token_id(text)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def can_decode(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size

    def _check_id(self, token_id: int) -> None:
        if not self.can_decode(token_id):
            raise InvalidRequestError(
                f"token id {token_id} is outside the vocabulary (size {self.vocab_size})"
            )

    # ---- chat ------------------------------------------------------------------------------------

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **{**self._special_tokens, **template_kwargs},  # the caller's values win, as in transformers
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        # the template writes BOS itself where the model wants it, so no special tokens are added here
        prompt = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self.encode(prompt, add_special_tokens=False)


# ---- helpers: folders -------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"cannot parse {path}: {error}") from error


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _folder_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    if (jinja_file := folder / "chat_template.jinja").is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _text_shrink(description: dict[str, Any]) -> int | None:
    """How many times fewer characters than a text the pieces that a tokenizer (its tokenizer.json) splits
    into tokens may have; None where it may drop text, or fuse unknown text into one token."""
    model = description.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and not model.get("byte_fallback")):
        return None
    if not _keeps_text(description.get("pre_tokenizer")):
        return None
    return _normalizer_shrink(description.get("normalizer"))


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", ()):
            part_factor = _normalizer_shrink(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind == "Replace":  # one character for at least one: " " -> "▁"
        pattern = (normalizer.get("pattern") or {}).get("String")
        return 1 if pattern is not None and len(pattern) == 1 and normalizer.get("content") else None
    return _SHRINK_BY_NORMALIZER.get(kind)


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(_keeps_text(part) for part in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _decoder_kind(decoder: dict[str, Any] | None) -> tuple[str, bool]:
    """How token strings turn into bytes ("byte_level", "sentencepiece" or "other"), and whether
    decoding drops the space SentencePiece put before the first word."""
    parts = decoder.get("decoders", []) if decoder and decoder.get("type") == "Sequence" else [decoder or {}]
    if any(part.get("type") == "ByteLevel" for part in parts):
        return "byte_level", False
    for part in parts:
        if part.get("type") == "Metaspace":
            return "sentencepiece", part.get("prepend_scheme", "always") != "never" and part.get(
                "add_prefix_space", True
            )
    if any(
        part.get("type") == "Replace" and part.get("pattern", {}).get("String") == _SPM_SPACE
        for part in parts
    ):
        return "sentencepiece", any(
            part.get("type") == "Strip" and part.get("start", 0) > 0 for part in parts
        )
    return "other", False


# ---- helpers: GGUF ----------------------------------------------------------------------------


class _GgufMetadata:
    """Typed access to a GGUF reader's key/value fields."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        metadata_field = self._fields.get(key)
        if metadata_field is None:
            return default
        try:
            return metadata_field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as error:
            raise ModelLoadError(f"GGUF metadata {key} is corrupt: {error}") from error


def _byte_level_backend(tokens: list[str], merges: list[str], pre_type: str) -> tokenizers.Tokenizer:
    splits = _SPLITS_BY_PRE_TYPE.get(pre_type)
    if splits is None:
        supported = ", ".join(sorted(_SPLITS_BY_PRE_TYPE))
        raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre_type!r}; supported: {supported}")
    vocab = _unique_vocab(tokens)
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    model = models.BPE(vocab=vocab, merges=merge_pairs, ignore_merges=pre_type in _IGNORE_MERGES_PRE_TYPES)
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits)]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(
    tokens: list[str],
    scores: list[float],
    token_types: list[int],
    unknown_id: int | None,
    add_space_prefix: bool,
) -> tokenizers.Tokenizer:
    vocab = _unique_vocab(tokens)
    unknown = tokens[unknown_id] if unknown_id is not None and 0 <= unknown_id < len(tokens) else None
    model = models.BPE(
        vocab=vocab,
        merges=_merges_from_scores(vocab, tokens, scores, token_types),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    # llama.cpp puts a space before the text and after every special token: a normalizer runs per
    # stretch of text between added tokens, which is exactly that (Metaspace would only do the first).
    space_to_meta = normalizers.Replace(" ", _SPM_SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), space_to_meta])
        if add_space_prefix
        else space_to_meta
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    return backend


def _unique_vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # a repeated spelling keeps its first id, as lookups find it
    return vocab


def _merges_from_scores(
    vocab: dict[str, int], tokens: list[str], scores: list[float], token_types: list[int]
) -> list[tuple[str, str]]:
    """SentencePiece BPE merges: every split of a normal token into two known pieces, best score first."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id, token in enumerate(tokens):
        if token_types[token_id] != 1 or len(token) < 2 or vocab[token] != token_id:  # 1: normal token
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_gguf_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int]
) -> None:
    # control tokens are special (skipped by skip_special_tokens); both kinds are matched whole in text
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type == _GGUF_CONTROL
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type == _GGUF_USER_DEFINED
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
