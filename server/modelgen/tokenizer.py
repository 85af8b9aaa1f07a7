"""The synthetic byte-level BPE vocabulary ("gpt2" tokenizer model) and its special tokens.

Layout of the token list: the 256 byte tokens (GPT-2's byte->unicode mapping, so any UTF-8
text round-trips), the tokens made by a few hundred merges of common English fragments, the
architecture family's special tokens, then filler words up to n_vocab. Filler words are NORMAL
tokens that no merge produces, so a random model's output detokenizes to readable gibberish
(" bako", " tesu") instead of empty strings, as real vocabularies of 150k tokens would.
"""

from __future__ import annotations

import dataclasses
import enum

from server.modelgen import templates


class TokenType(enum.IntEnum):
    """llama.cpp's LLAMA_TOKEN_TYPE_* (tokenizer.ggml.token_type)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclasses.dataclass(frozen=True)
class Family:
    """A chat-format family: its special tokens, which of them play BOS/EOS/EOT/PAD, the pre-tokenizer."""

    name: str
    pre: str
    specials: tuple[tuple[str, TokenType], ...]
    bos: str
    eos: str
    eot: str
    pad: str
    add_bos: bool
    chat_template: str


_C, _U = TokenType.CONTROL, TokenType.USER_DEFINED

CHATML = Family(
    name="chatml",
    pre="qwen2",
    specials=(
        ("<|endoftext|>", _C),
        ("<|im_start|>", _C),
        ("<|im_end|>", _C),
        # Qwen3 marks these non-special (USER_DEFINED): they show up in the generated text
        ("<tool_call>", _U),
        ("</tool_call>", _U),
        ("<tool_response>", _U),
        ("</tool_response>", _U),
        ("<think>", _U),
        ("</think>", _U),
    ),
    bos="<|endoftext|>",
    eos="<|im_end|>",
    eot="<|im_end|>",
    pad="<|endoftext|>",
    add_bos=False,
    chat_template=templates.CHATML,
)

# o200k_harmony's specials. llama.cpp itself turns <|channel|>, <|message|>, <|start|> and
# <|constrain|> into USER_DEFINED (rendered) and drops <|end|> from the end-of-generation set
# because <|return|> and <|call|> exist (src/llama-vocab.cpp).
HARMONY = Family(
    name="harmony",
    pre="gpt-4o",
    specials=(
        ("<|startoftext|>", _C),
        ("<|endoftext|>", _C),
        ("<|return|>", _C),
        ("<|constrain|>", _C),
        ("<|channel|>", _C),
        ("<|start|>", _C),
        ("<|end|>", _C),
        ("<|message|>", _C),
        ("<|call|>", _C),
    ),
    bos="<|startoftext|>",
    eos="<|return|>",
    eot="<|return|>",
    pad="<|endoftext|>",
    add_bos=False,
    chat_template=templates.HARMONY,
)

MISTRAL = Family(
    name="mistral",
    pre="qwen2",
    specials=(("<unk>", TokenType.UNKNOWN), ("<s>", _C), ("</s>", _C)),
    bos="<s>",
    eos="</s>",
    eot="</s>",
    pad="<unk>",
    add_bos=True,
    chat_template=templates.MISTRAL,
)

# Gemma 4's turn and channel markers. Its conversion (llama.cpp conversion/gemma.py) marks the
# channel, tool-call and tool-response markers and the string quote USER_DEFINED so they are
# rendered for the chat parser; llama.cpp ends generation at <eos>, <turn|> and <|tool_response>
# (src/llama-vocab.cpp). The real tokenizer is SentencePiece-style BPE ("gemma4"); the synthetic
# vocabulary stays byte-level with Qwen's pre-tokenizer, which a streamer never sees.
GEMMA4 = Family(
    name="gemma4",
    pre="qwen2",
    specials=(
        ("<pad>", _C),
        ("<eos>", _C),
        ("<bos>", _C),
        ("<|turn>", _C),
        ("<turn|>", _C),
        ("<|tool>", _C),
        ("<tool|>", _C),
        ("<|channel>", _U),
        ("<channel|>", _U),
        ("<|tool_call>", _U),
        ("<tool_call|>", _U),
        ("<|tool_response>", _U),
        ("<tool_response|>", _U),
        ('<|"|>', _U),
    ),
    bos="<bos>",
    eos="<eos>",
    eot="<turn|>",
    pad="<pad>",
    add_bos=True,
    chat_template=templates.GEMMA4,
)

FAMILY_BY_ARCH = {
    "qwen3moe": CHATML,
    "qwen2moe": CHATML,
    "hy_v3": CHATML,
    "gpt-oss": HARMONY,
    "llama": MISTRAL,
    "gemma4": GEMMA4,
}

# Fragments whose left-to-right merges form the merge list (earlier = higher priority).
_MERGE_WORDS = (
    " the",
    " and",
    " of",
    " to",
    " in",
    " is",
    " that",
    " for",
    " it",
    " with",
    " as",
    " on",
    " be",
    " you",
    " this",
    " are",
    " was",
    " not",
    " or",
    " at",
    " by",
    " from",
    " have",
    " an",
    " they",
    " which",
    " one",
    " all",
    " we",
    " can",
    " has",
    " will",
    " more",
    " The",
    " A",
    " I",
    " It",
    " In",
    " This",
    " We",
    " You",
    "ing",
    "ion",
    "tion",
    "er",
    "ed",
    "es",
    "en",
    "re",
    "th",
    "he",
    "an",
    "in",
    "on",
    "at",
    "or",
    "al",
    "ar",
    "ou",
    "st",
    "ll",
    "ly",
    "le",
    "nd",
    "it",
    "is",
    "ent",
    "ment",
    " model",
    " token",
    " expert",
    " memory",
    " flash",
    " layer",
    " cache",
    " stream",
    "  ",
    "    ",
    "\n\n",
    ".\n",
)

_SYLLABLE_CONSONANTS = "bcdfghjklmnprstvwz"
_SYLLABLE_VOWELS = "aeiou"


def _gpt2_byte_table() -> tuple[str, ...]:
    """GPT-2's reversible byte -> printable unicode character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    return tuple(chr(table[b]) for b in range(256))


BYTE_TO_UNICODE = _gpt2_byte_table()


def encode_bytes(text: str) -> str:
    """`text` as a byte-level BPE token string (UTF-8 bytes through the GPT-2 table)."""
    return "".join(BYTE_TO_UNICODE[b] for b in text.encode("utf-8"))


def _build_merges() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(merges as 'left right' strings, the tokens they create), both in rank order."""
    merges: list[str] = []
    created: list[str] = []
    seen: set[str] = set(BYTE_TO_UNICODE)
    for word in _MERGE_WORDS:
        symbols = encode_bytes(word)
        for k in range(1, len(symbols)):
            left, right = symbols[:k], symbols[k]
            merged = left + right
            if merged not in seen:
                seen.add(merged)
                merges.append(f"{left} {right}")
                created.append(merged)
    return tuple(merges), tuple(created)


MERGES, MERGED_TOKENS = _build_merges()


def base_vocab_size(arch: str) -> int:
    """Tokens the vocabulary needs before any filler: bytes + merged tokens + specials."""
    return len(BYTE_TO_UNICODE) + len(MERGED_TOKENS) + len(FAMILY_BY_ARCH[arch].specials)


def _filler_word(i: int) -> str:
    """The i-th filler word: ' ' + a bijective base-90 number written in consonant-vowel syllables."""
    n_cons, n_vow = len(_SYLLABLE_CONSONANTS), len(_SYLLABLE_VOWELS)
    base = n_cons * n_vow
    n = i + 1
    syllables: list[str] = []
    while n > 0:
        n, digit = divmod(n - 1, base)
        syllables.append(_SYLLABLE_CONSONANTS[digit // n_vow] + _SYLLABLE_VOWELS[digit % n_vow])
    return " " + "".join(reversed(syllables))


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Everything the tokenizer.* GGUF keys hold."""

    family: Family
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    eot_id: int
    pad_id: int


def build_vocab(arch: str, n_vocab: int) -> Vocab:
    """The vocabulary of `n_vocab` tokens for `arch` (n_vocab >= base_vocab_size(arch))."""
    family = FAMILY_BY_ARCH[arch]
    tokens = [*BYTE_TO_UNICODE, *MERGED_TOKENS]
    types = [int(TokenType.NORMAL)] * len(tokens)
    special_ids: dict[str, int] = {}
    for text, kind in family.specials:
        special_ids[text] = len(tokens)
        tokens.append(text)
        types.append(int(kind))
    if len(tokens) > n_vocab:
        raise ValueError(f"n_vocab {n_vocab} < base vocabulary {len(tokens)}")
    taken = set(tokens)
    i = 0
    while len(tokens) < n_vocab:
        word = encode_bytes(_filler_word(i))
        i += 1
        if word not in taken:
            taken.add(word)
            tokens.append(word)
    types.extend([int(TokenType.NORMAL)] * (n_vocab - len(types)))
    return Vocab(
        family=family,
        tokens=tuple(tokens),
        token_types=tuple(types),
        merges=MERGES,
        bos_id=special_ids[family.bos],
        eos_id=special_ids[family.eos],
        eot_id=special_ids[family.eot],
        pad_id=special_ids[family.pad],
    )
