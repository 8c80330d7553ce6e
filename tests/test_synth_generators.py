"""Candidate generators: Appendix C templates, μ paraphrases per seed, stub-server round trip,
local causal LM (tiny random GPT-2 and the real stories260K), candidate files."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from dpft.synth.generators import (TEMPLATES, GeneratorError, HFCausalLMBackend, OpenAIChatBackend,
                                   build_candidate_pool, load_candidate_file)


@pytest.fixture()
def stub_server():
    """An OpenAI-compatible /chat/completions stub on 127.0.0.1 (random port)."""
    seen = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
            if self.headers.get("Authorization") != "Bearer sk-test":
                self.send_response(401)
                self.end_headers()
                self.wfile.write(b'{"error": "bad key"}')
                return
            user = body["messages"][1]["content"]
            k = len(seen)
            content = f'"snippet {k}"\nextra line' if user == "Generate one." else f"paraphrase {k} of {user}"
            out = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", seen
    srv.shutdown()


def test_openai_stub_round_trip(stub_server, monkeypatch):
    url, seen = stub_server
    monkeypatch.setenv("DPFT_LLM_BASE_URL", url)
    monkeypatch.setenv("DPFT_LLM_API_KEY", "sk-test")
    pool = build_candidate_pool(OpenAIChatBackend(model="m"), "sst2", n_seeds=2, mu=3)
    assert len(seen) == 2 * 4 and len(pool.texts) == 8  # L = μ + 1 per seed
    assert pool.seed_of == [0] * 4 + [1] * 4
    assert pool.texts[0] == "snippet 1"  # quotes and trailing lines stripped
    assert pool.texts[1] == "paraphrase 2 of snippet 1"
    assert all(s["path"] == "/v1/chat/completions" and s["auth"] == "Bearer sk-test" for s in seen)
    gen, para = TEMPLATES["sst2"]
    assert seen[0]["body"]["messages"][0]["content"] == gen
    assert seen[1]["body"]["messages"][0]["content"] == para
    assert seen[0]["body"]["temperature"] == 1.2 and seen[0]["body"]["model"] == "m"


def test_openai_errors(stub_server, monkeypatch):
    url, _ = stub_server
    monkeypatch.delenv("DPFT_LLM_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(GeneratorError, match="DPFT_LLM_BASE_URL"):
        OpenAIChatBackend()
    with pytest.raises(GeneratorError, match="HTTP 401"):
        OpenAIChatBackend(base_url=url, api_key="wrong").complete("x")
    with pytest.raises(GeneratorError, match="template"):
        build_candidate_pool(OpenAIChatBackend(base_url=url, api_key="sk-test"), "nope", 1)


def test_local_causal_lm_tiny_random(tiny_model_dir):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=tok.vocab_size, n_embd=16, n_layer=1, n_head=2, n_positions=256))
    be = HFCausalLMBackend(model=model, tokenizer=tok, max_new_tokens=6, seed=1)
    pool = build_candidate_pool(be, "sst5", n_seeds=2, mu=3, dedupe=False)
    assert len(pool.texts) <= 8 and len(pool.texts) >= 2
    assert all(isinstance(t, str) and t for t in pool.texts)
    be2 = HFCausalLMBackend(model=model, tokenizer=tok, max_new_tokens=6, seed=1)
    assert build_candidate_pool(be2, "sst5", n_seeds=2, mu=3, dedupe=False).texts == pool.texts  # seeded


def test_local_causal_lm_real_stories260k(shared_data):
    be = HFCausalLMBackend(str(shared_data / "models" / "stories260K"), max_new_tokens=10, seed=0)
    pool = build_candidate_pool(be, "sst2", n_seeds=1, mu=2)
    assert 1 <= len(pool.texts) <= 3 and all(t.strip() for t in pool.texts)
    with pytest.raises(GeneratorError, match="cannot load"):
        HFCausalLMBackend(str(shared_data / "nothing-here"))


def test_candidate_file(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("a fine film\n\nshort\na fine film\nthe plot is a dull mess of ideas\n")
    assert load_candidate_file(p) == ["a fine film", "short", "the plot is a dull mess of ideas"]
    assert load_candidate_file(p, min_words=2, max_words=4) == ["a fine film"]
    j = tmp_path / "c.jsonl"
    j.write_text('{"sentence": "x y"}\n{"sentence": "z"}\n')
    assert load_candidate_file(j, column="sentence") == ["x y", "z"]
    with pytest.raises(GeneratorError, match="no column"):
        load_candidate_file(j)
    with pytest.raises(GeneratorError, match="not found"):
        load_candidate_file(tmp_path / "missing.txt")
