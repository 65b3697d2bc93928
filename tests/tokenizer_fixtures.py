"""A tiny byte-level BPE tokenizer for tests, trained on the spot (no model hub needed).

``make_tokenizer(directory)`` trains (once per process, then cached) a byte-level BPE
tokenizer on a fixed corpus of English and unicode text, writes it with
``save_pretrained(directory)`` and returns ``AutoTokenizer.from_pretrained(directory)``.
Tiny test checkpoints get it as their tokenizer: give their configs
``vocab_size=TOKENIZER_VOCAB_SIZE`` and the special-token ids below.

Contract of the tokenizer:

- byte-level, so every string round-trips through encode/decode, and characters that are
  rare in the corpus (most emoji, CJK, Cyrillic) are split into byte tokens, which is what
  the detokenizer tests need;
- ``len(tokenizer) <= TOKENIZER_VOCAB_SIZE == 512``;
- special tokens ``<s>`` (bos, id 0), ``</s>`` (eos, id 1), ``<unk>`` (id 2), ``<pad>``
  (id 3), ``<|im_start|>`` (id 4), ``<|im_end|>`` (id 5);
- no automatic bos/eos: ``tokenizer("hi").input_ids`` are exactly the tokens of "hi"
  (no post-processor adds anything), so prompt token ids are what the text says;
- ``clean_up_tokenization_spaces`` is off, so ``decode`` is a pure function of the tokens;
- a ChatML ``chat_template`` (the one SmolLM2 uses, without its default system prompt)
  that honours ``add_generation_prompt``.
"""

# The test texts use look-alike characters on purpose.
# ruff: noqa: RUF001

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

TOKENIZER_VOCAB_SIZE = 512
BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, PAD_TOKEN = "<s>", "</s>", "<unk>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, PAD_TOKEN, IM_START, IM_END]
BOS_TOKEN_ID, EOS_TOKEN_ID, UNK_TOKEN_ID, PAD_TOKEN_ID = 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged attention engine keeps the key-value cache in fixed-size blocks.",
    "Hello, world! How are you doing today?",
    "Once upon a time, there was a little robot who loved to read books.",
    "The scheduler gives each request a share of the token budget.",
    "Please summarize the following article in three sentences.",
    "It was the best of times, it was the worst of times.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e-5",
    "Email me at someone@example.com or visit https://example.org/path?q=1.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    '{"name": "pagedllm", "version": "0.1", "tags": ["llm", "inference"]}',
    "What is the capital of France? The capital of France is Paris.",
    "She sells seashells by the seashore; the shells she sells are surely seashells.",
    "To be, or not to be, that is the question.",
    "The weather today is sunny with a chance of rain in the evening.",
    "I can't believe it's already Friday! Let's go out for dinner.",
    "Machine learning models learn patterns from data.",
    "The café serves crème brûlée, jalapeño nachos and a piña colada.",
    "Zoë and Chloé visited São Paulo, Kraków, Reykjavík and Zürich.",
    "Ångström, façade, naïve, coöperate, résumé, déjà vu, über, señor.",
    "Ça va très bien, merci ! Où est la gare ?",
    "Straße, Größe, Äpfel, Öl und Übermut.",
    "Привет, как дела? Всё хорошо, спасибо.",
    "Москва — столица России. Мы любим читать книги.",
    "日本語のテキストです。今日はいい天気ですね。",
    "你好，世界！我们今天去公园散步吧。",
    "한국어 문장도 조금 있습니다. 감사합니다!",
    "Γειά σου κόσμε! Ελληνικά γράμματα: α β γ δ ε.",
    "مرحبا بالعالم، هذا نص عربي قصير.",
    "שלום עולם, זה טקסט בעברית.",
    "Emoji time: 😀 😂 🥲 🎉 🚀 🌍 ❤️ 👍 🔥 ✨",
    "Developers: 👩‍💻 👨‍💻 🧑‍🔬 and families: 👨‍👩‍👧‍👦.",
    "Flags and skin tones: 🇫🇷 🇯🇵 🇺🇸 👋🏽 👍🏿 🏳️‍🌈",
    "Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ π θ λ µ ° ± × ÷",
    "Currency: $5, €10, £20, ¥1000, ₹50, ₿0.01",
    "Quotes: “double”, ‘single’, «guillemets», and an ellipsis…",
    "Dashes – and — and bullets • and arrows → ← ↑ ↓",
    "Tabs\tand\tnewlines\nare whitespace too.\n\n",
    "   Leading spaces and trailing spaces   ",
    "ALL CAPS TEXT IS LOUD. lower case text is quiet.",
    "The model said: <think>let me reason</think> and then answered.",
]

_SUBJECTS = ["The cat", "My friend", "A tiny model", "The engine", "Our team", "Ана", "小明"]
_VERBS = ["reads", "writes", "computes", "streams", "caches", "loves", "ignores"]
_OBJECTS = ["tokens", "the blocks", "a poem", "emoji 🎉", "café notes", "данные", "数据"]


def _corpus() -> list[str]:
    """A few hundred lines: the fixed sentences plus seeded combinations of them."""
    rng = random.Random(1234)
    lines = list(_SENTENCES) * 3
    for _ in range(250):
        lines.append(
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
            f"{rng.randint(0, 999)} times, {rng.choice(_SENTENCES).lower()}"
        )
    return lines


def _train_tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    assert tokenizer.get_vocab_size() <= TOKENIZER_VOCAB_SIZE
    return tokenizer.to_str()


_TOKENIZER_JSON: str | None = None


def make_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """Write the test tokenizer into ``directory`` and return it loaded from there.

    The BPE training runs once per process; later calls only write and reload files.
    ``directory`` is created if missing; existing tokenizer files in it are overwritten.
    """
    global _TOKENIZER_JSON
    if _TOKENIZER_JSON is None:
        _TOKENIZER_JSON = _train_tokenizer_json()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_TOKENIZER_JSON),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    loaded = AutoTokenizer.from_pretrained(directory)
    assert len(loaded) <= TOKENIZER_VOCAB_SIZE, len(loaded)
    return loaded


def tokenizer_config(directory: Path) -> dict:
    """The ``tokenizer_config.json`` that ``make_tokenizer`` wrote (for inspection)."""
    return json.loads((Path(directory) / "tokenizer_config.json").read_text())
