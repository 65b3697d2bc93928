"""Incremental detokenization, stop strings and the test tokenizer they run on."""

# The test texts use look-alike characters on purpose.
# ruff: noqa: RUF001

from __future__ import annotations

import random

import pytest
from tokenizer_fixtures import (
    EOS_TOKEN_ID,
    TOKENIZER_VOCAB_SIZE,
    make_tokenizer,
)
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from pagedllm.core.detokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    convert_ids_to_tokens_for_logprobs,
)

TEXTS = [
    "Hello, world! How are you doing today?",
    "The café serves crème brûlée; Zoë visited Kraków.",
    "Привет, как дела? Всё хорошо.",
    "日本語のテキストです。你好，世界！",
    "Developers 👩‍💻 and families 👨‍👩‍👧‍👦 wave 👋🏽 under 🇫🇷 flags 🏳️‍🌈.",
    "Rare glyphs: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ ᚠᚢᚦ 🦩🪐 and a lone e\u0301 combining accent.",
    "def add(a, b):\n    return a + b\n",
    "   spaces, tabs\tand\n\nnewlines   ",
    "🎉",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def byte_token_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """``text`` as one token per UTF-8 byte, so every multi-byte character is split."""
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    return [tokenizer.convert_tokens_to_ids(char) for piece, _ in pieces for char in piece]


def stream(
    tokenizer: PreTrainedTokenizerFast,
    prompt_ids: list[int],
    output_ids: list[int],
    rng: random.Random | None = None,
    **kwargs: bool,
) -> tuple[list[str], str]:
    """Feed ``output_ids`` in chunks (sizes from ``rng``, else 1); return deltas and flush.

    Checks on the way that the text streamed so far is always final: a prefix of the
    full decode, so no delta holds a partial character the full decode does not have.
    """
    full = tokenizer.decode(output_ids, **kwargs)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = []
    i = 0
    while i < len(output_ids):
        n = rng.randint(1, 4) if rng else 1
        delta = detok.decode_next(output_ids[i : i + n])
        i += n
        deltas.append(delta)
        assert full.startswith(detok.output_text), (detok.output_text, full)
        assert not delta.endswith("\ufffd")
    flushed = detok.flush()
    assert detok.output_text == "".join(deltas) + flushed
    return deltas, flushed


def test_streaming_equals_full_decode_for_real_texts(tokenizer):
    prompt_ids = tokenizer("Answer in any language: ").input_ids
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        deltas, flushed = stream(tokenizer, prompt_ids, ids)
        assert "".join(deltas) == text
        assert flushed == ""
        assert not any("\ufffd" in delta for delta in deltas)


def test_the_texts_do_split_characters_across_tokens(tokenizer):
    ids = tokenizer("👩‍💻 日本語 привет").input_ids
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)


def test_characters_split_into_single_bytes_stream_whole(tokenizer):
    for text in TEXTS:
        ids = byte_token_ids(tokenizer, text)
        assert tokenizer.decode(ids) == text
        deltas, flushed = stream(tokenizer, [], ids)
        assert "".join(deltas) == text and flushed == ""
        assert not any("\ufffd" in delta for delta in deltas)


def test_text_before_an_incomplete_character_is_not_held(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    emoji = byte_token_ids(tokenizer, "🎉")
    assert detok.decode_next([*tokenizer("ab").input_ids, emoji[0]]) == "ab"
    assert detok.decode_next(emoji[1:3]) == ""
    assert detok.decode_next(emoji[3:]) == "🎉"
    assert detok.flush() == ""


def test_incomplete_character_at_the_end_comes_out_on_flush(tokenizer):
    ids = tokenizer("ok ").input_ids + byte_token_ids(tokenizer, "🎉")[:2]
    deltas, flushed = stream(tokenizer, [], ids)
    assert "".join(deltas) == "ok "
    assert flushed == tokenizer.decode(ids)[len("ok ") :] and flushed.startswith("\ufffd")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("spaces_between_special_tokens", [True, False])
def test_random_token_sequences(tokenizer, skip_special_tokens, spaces_between_special_tokens):
    rng = random.Random(f"{skip_special_tokens}{spaces_between_special_tokens}")
    kwargs = {
        "skip_special_tokens": skip_special_tokens,
        "spaces_between_special_tokens": spaces_between_special_tokens,
    }
    byte_pool = [i for text in TEXTS for i in byte_token_ids(tokenizer, text)]
    for _ in range(150):
        if rng.random() < 0.5:
            pool = range(len(tokenizer))
        else:
            pool = byte_pool
        output_ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        prompt_ids = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
        deltas, flushed = stream(tokenizer, prompt_ids, output_ids, rng, **kwargs)
        assert "".join(deltas) + flushed == tokenizer.decode(output_ids, **kwargs)


def test_special_tokens_skipped_or_kept(tokenizer):
    text = "<|im_start|>assistant\nHello 👋🏽<|im_end|></s>"
    ids = tokenizer(text).input_ids
    assert ids[-1] == EOS_TOKEN_ID
    kept, _ = stream(tokenizer, [], ids, skip_special_tokens=False)
    assert "".join(kept) == text
    skipped, _ = stream(tokenizer, [], ids, skip_special_tokens=True)
    assert "".join(skipped) == "assistant\nHello 👋🏽"


def test_prompt_ending_inside_a_character(tokenizer):
    emoji = byte_token_ids(tokenizer, "🎉")
    deltas, flushed = stream(tokenizer, emoji[:2], [*emoji[2:], *tokenizer(" ok").input_ids])
    assert "".join(deltas) + flushed == tokenizer.decode([*emoji[2:], *tokenizer(" ok").input_ids])


def test_first_output_token_keeps_its_leading_space_with_sentencepiece_decoding():
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    sp_tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert sp_tokenizer.decode([2]) == "world"  # a lone token loses its space
    detok = IncrementalDetokenizer(sp_tokenizer, [1])
    assert detok.decode_next([2]) == " world"
    assert detok.decode_next([3]) == "!"
    assert detok.decode_next([2]) == " world"
    assert detok.output_text == " world! world"


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, token_ids: list[int], **kwargs: bool) -> str:
        self.longest = max(self.longest, len(token_ids))
        self.kwargs = kwargs
        return self.tokenizer.decode(token_ids, **kwargs)

    def batch_decode(self, sequences: list[list[int]], **kwargs: bool) -> list[str]:
        return [self.decode(token_ids, **kwargs) for token_ids in sequences]


def test_other_tokenizers_get_the_options_through_decode(tokenizer):
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [], False, False)
    assert detok.decode_next(tokenizer("<s>Hi").input_ids) == "<s>Hi"
    assert counting.kwargs == {
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "clean_up_tokenization_spaces": False,
    }


def test_each_step_decodes_a_short_window(tokenizer):
    counting = CountingTokenizer(tokenizer)
    prompt_ids = tokenizer(" ".join(TEXTS)).input_ids
    output_ids = tokenizer(" ".join(TEXTS * 20)).input_ids
    detok = IncrementalDetokenizer(counting, prompt_ids)
    for token_id in output_ids:
        detok.decode_next([token_id])
    detok.flush()
    assert detok.output_text == tokenizer.decode(output_ids)
    assert len(output_ids) > 1000
    assert counting.longest <= 16


def test_stop_string_spanning_deltas_found_in_stream(tokenizer):
    text = "Once upon a time, there was a little robot. The end."
    for stop, include, expected in [
        ("little robot", False, "Once upon a time, there was a "),
        ("little robot", True, "Once upon a time, there was a little robot"),
        ("a time", False, "Once upon "),
    ]:
        detok = IncrementalDetokenizer(tokenizer, [])
        found = None
        for token_id in byte_token_ids(tokenizer, text):
            delta = detok.decode_next([token_id])
            found = check_stop_strings(detok.output_text, len(delta), [stop], include)
            if found:
                break
        assert found is not None and found[0] == stop
        assert detok.output_text[: found[1]] == expected


def test_stop_strings_contract():
    text = "Hello world"
    # "wor" came earlier, "ld" is new: the stop string spans the two.
    assert check_stop_strings(text, 2, ["world"], False) == ("world", 6)
    assert check_stop_strings(text, 2, ["world"], True) == ("world", 11)
    # Earliest start wins, whatever the list order; ties go to the earliest end.
    assert check_stop_strings("a stop1 stop2", 13, ["stop2", "stop1"], False) == ("stop1", 2)
    assert check_stop_strings("xxabc", 5, ["abc", "ab"], False) == ("ab", 2)
    assert check_stop_strings("xxabc", 5, ["abc", "ab"], True) == ("ab", 4)
    assert check_stop_strings("a stop1 stop2", 13, ["op1 s", "stop1"], False) == ("stop1", 2)


def test_stop_strings_no_false_positives():
    # Entirely inside old text: reported in an earlier step, not again.
    assert check_stop_strings("stop here", 1, ["stop"], False) is None
    assert check_stop_strings("stop here", 5, ["stop"], False) is None
    # Its last character "p" is new: found now.
    assert check_stop_strings("stop here", 6, ["stop"], False) == ("stop", 0)
    assert check_stop_strings("Hello world", 5, ["planet"], True) is None
    assert check_stop_strings("Hello world", 0, ["world"], True) is None
    assert check_stop_strings("Hello world", 3, [], True) is None
    assert check_stop_strings("Hello world", 3, [""], True) is None
    assert check_stop_strings("Hello world", 3, ["Hello world!"], True) is None


def test_logprob_tokens_are_single_token_decodes(tokenizer):
    ids = tokenizer("<s>Hi 👩‍💻 café</s>").input_ids
    tokens = convert_ids_to_tokens_for_logprobs(tokenizer, ids)
    assert tokens == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert tokens[0] == "<s>" and tokens[-1] == "</s>"
    assert "\ufffd" in tokens  # a fragment of the emoji
    assert convert_ids_to_tokens_for_logprobs(tokenizer, []) == []
    assert convert_ids_to_tokens_for_logprobs(CountingTokenizer(tokenizer), ids) == tokens


def test_tokenizer_round_trips_unicode(tokenizer):
    assert len(tokenizer) <= TOKENIZER_VOCAB_SIZE == 512
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert max(ids, default=0) < TOKENIZER_VOCAB_SIZE
        assert tokenizer.decode(ids) == text
    # No bos or eos is added automatically.
    assert tokenizer("Hello").input_ids == tokenizer.convert_tokens_to_ids(
        tokenizer.tokenize("Hello")
    )
    assert tokenizer.bos_token_id not in tokenizer("Hello").input_ids


def test_tokenizer_special_tokens_and_determinism(tokenizer, tmp_path):
    assert [tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token] == [
        "<s>",
        "</s>",
        "<unk>",
    ]
    assert tokenizer.pad_token == "<pad>"
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [4, 5]
    assert tokenizer("<|im_start|>user").input_ids[0] == 4
    assert make_tokenizer(tmp_path).get_vocab() == tokenizer.get_vocab()


def test_chat_template_renders_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Salut 👋"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSalut 👋<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == rendered + "<|im_start|>assistant\n"
