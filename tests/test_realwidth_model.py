"""GLM-5 at real width, 4 layers deep (dsa_image/build/realwidth_model.py): the config is GLM-5's model
facts with the depth the one change, the tokenizer has exactly vocab_size tokens, and every file
is the same on every run."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dsa_image.serving import memory_plan
from dsa_image.build import realwidth_model, tiny_model

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "make_realwidth_model.py"
GLM5 = tomllib.loads((REPO / "recipes" / "models" / "glm-5.toml").read_text())
CONFIG = realwidth_model.config()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("realwidth") / realwidth_model.NAME
    realwidth_model.write_model(out)
    return out


def test_every_model_fact_of_glm5_is_kept_but_the_depth():
    facts = {**GLM5["config"], **GLM5["published"]}
    changed = {key: CONFIG[key] for key in facts if CONFIG[key] != facts[key]}
    assert changed == {"num_hidden_layers": 4} == realwidth_model.CHANGED
    assert facts["num_hidden_layers"] == 78
    # The figures, read from the recipe's facts rather than typed here.
    assert (CONFIG["hidden_size"], CONFIG["num_attention_heads"], CONFIG["q_lora_rank"], CONFIG["kv_lora_rank"]) == (
        6144, 64, 2048, 512)
    assert (CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"], CONFIG["n_shared_experts"],
            CONFIG["first_k_dense_replace"]) == (256, 8, 1, 3)
    assert (CONFIG["index_n_heads"], CONFIG["index_head_dim"], CONFIG["index_topk"]) == (32, 128, 2048)
    assert CONFIG["num_nextn_predict_layers"] == 1 and CONFIG["vocab_size"] == 154880


def test_what_the_facts_do_not_carry_is_the_tiny_models_and_no_shape():
    facts = {**GLM5["config"], **GLM5["published"]}
    borrowed = {key: value for key, value in CONFIG.items() if key not in facts}
    assert borrowed == {key: tiny_model.CONFIG[key] for key in borrowed}
    assert not set(borrowed) & set(memory_plan.REQUIRED_CONFIG)  # the plan computes with none of them
    assert tiny_model.kernel_shape_problems(CONFIG) == []


def test_three_dense_layers_and_one_moe_layer_with_every_expert():
    moe = [memory_plan.is_moe_layer(CONFIG, i) for i in range(CONFIG["num_hidden_layers"])]
    assert moe == [False, False, False, True]
    parts = memory_plan.layer_parts(CONFIG, moe=True)
    assert parts["mlp.routed_experts"] == 256 * 3 * 6144 * 2048


def test_the_vocabulary_is_filled_to_exactly_vocab_size():
    vocab, merges = tiny_model.build_vocab(CONFIG["vocab_size"], fill=True)
    assert len(vocab) == CONFIG["vocab_size"] and sorted(vocab.values()) == list(range(CONFIG["vocab_size"]))
    corpus_merges = sum(1 for _ in tiny_model.iter_merges(tiny_model._CORPUS))
    assert len(merges) == corpus_merges  # every merge the corpus has, then the fillers
    assert vocab[tiny_model.fill_token(0)] == len(tiny_model.SPECIAL_TOKENS) + 256 + corpus_merges
    for left, right in merges:
        assert left in vocab and right in vocab and left + right in vocab


def test_filling_leaves_a_vocabulary_the_corpus_fills_as_it_was():
    assert tiny_model.build_vocab(1024, fill=True) == tiny_model.build_vocab(1024)
    with pytest.raises(tiny_model.TinyModelError, match="lengthen _CORPUS"):
        tiny_model.build_vocab(CONFIG["vocab_size"])  # without fill: the tiny model's rule


def test_tokenizers_loads_it_with_vocab_size_tokens_each_decoding_to_text(model_dir):
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is in the dev lock")
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == CONFIG["vocab_size"]
    texts = tok.decode_batch([[i] for i in range(len(tiny_model.SPECIAL_TOKENS), CONFIG["vocab_size"])])
    assert all(texts)  # an id the tokenizer does not know would decode to ""
    first_filler = tok.token_to_id(tiny_model.fill_token(0))
    assert tok.decode([CONFIG["vocab_size"] - 1]) == f" tok{CONFIG['vocab_size'] - 1 - first_filler}"
    text = "Sparse attention: the indexer picks 2048 keys. Ünïcödé 你好"
    assert tok.decode(tok.encode(text).ids) == text


def test_transformers_loads_config_and_tokenizer_offline(model_dir, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="transformers is in the dev lock")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert (config.num_hidden_layers, config.n_routed_experts, config.num_nextn_predict_layers) == (4, 256, 1)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == config.vocab_size
    assert tok.decode([config.vocab_size - 1]).startswith(" tok")


def test_the_readme_states_the_change_and_the_planned_weights(model_dir):
    text = (model_dir / "README.md").read_text()
    assert "num_hidden_layers 78 -> 4 (3 dense, 1 MoE)" in text and "256 routed experts" in text
    weights = memory_plan.checkpoint_bytes(CONFIG, memory_plan.SCHEMES["bf16"], with_mtp=False) / memory_plan.GIB
    assert f"{weights:.1f} GiB" in text and 24 < weights < 24.5


def test_the_directory_checks_against_the_generator(model_dir):
    assert realwidth_model.model_dir_differences(model_dir) == []
    assert subprocess.run([sys.executable, str(SCRIPT), "--check", str(model_dir)]).returncode == 0


def test_same_bytes_every_run_and_across_hash_seeds(tmp_path, model_dir):
    out = tmp_path / "again"
    subprocess.run([sys.executable, str(SCRIPT), str(out)], check=True, capture_output=True,
                   env={**os.environ, "PYTHONHASHSEED": "7"}, cwd=tmp_path)
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(p.name for p in out.iterdir()) and "README.md" in names
    for name in names:
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_the_script_refuses_a_directory_it_did_not_leave_empty(model_dir):
    again = subprocess.run([sys.executable, str(SCRIPT), str(model_dir)], capture_output=True, text=True)
    assert again.returncode == 1 and "remove it or choose another" in again.stderr
