"""The tiny GLM-5 model generator: kernel shapes, determinism, and a tokenizer that real
`tokenizers` / `transformers` load offline with exactly `vocab_size` tokens."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_image.build import tiny_model
from dsa_image.build.tiny_model import CONFIG, TinyModelError

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "make_tiny_model.py"
# The config we served on the H200 (docs/validation) and established the kernel shapes with,
# vendored so that a fresh clone checks against it: tests/data/README.md says where it is from.
REFERENCE_CONFIG = REPO / "tests" / "data" / "tiny-glm5-config.json"



def test_config_is_the_reference_config():
    assert CONFIG == json.loads(REFERENCE_CONFIG.read_text())


def test_config_fits_the_kernels():
    assert tiny_model.kernel_shape_problems(CONFIG) == []


@pytest.mark.parametrize(
    "key, bad",
    [
        ("kv_lora_rank", 256),
        ("qk_rope_head_dim", 128),
        ("index_head_dim", 64),
        ("index_n_heads", 16),
        ("index_topk", 1024),
        ("qk_nope_head_dim", 127),
        ("qk_nope_head_dim", 256),
        ("model_type", "deepseek_v32"),
        ("architectures", ["DeepseekV32ForCausalLM"]),
        ("max_position_embeddings", 2048),
        ("eos_token_id", 1024),
    ],
)
def test_each_broken_shape_is_named(key, bad):
    problems = tiny_model.kernel_shape_problems({**CONFIG, key: bad})
    assert len(problems) == 1 and problems[0].startswith(f"{key} = {bad!r}"), problems
    with pytest.raises(TinyModelError, match=key):
        tiny_model.model_files({**CONFIG, key: bad})


def test_index_n_heads_64_and_nope_128_fit():
    assert tiny_model.kernel_shape_problems({**CONFIG, "index_n_heads": 64, "qk_nope_head_dim": 128}) == []


def test_vocabulary_is_exactly_vocab_size_with_specials_first():
    vocab, merges = tiny_model.build_vocab(CONFIG["vocab_size"])
    assert len(vocab) == CONFIG["vocab_size"]
    assert sorted(vocab.values()) == list(range(CONFIG["vocab_size"]))
    for i, token in enumerate(tiny_model.SPECIAL_TOKENS):
        assert vocab[token] == i
    assert vocab[tiny_model.BOS] == CONFIG["bos_token_id"]
    assert vocab[tiny_model.EOS] == CONFIG["eos_token_id"]
    assert vocab[tiny_model.PAD] == CONFIG["pad_token_id"]
    # Every merge joins two tokens the vocabulary has, into one it has.
    for left, right in merges:
        assert left in vocab and right in vocab and left + right in vocab


def test_a_short_corpus_fails_closed(monkeypatch):
    monkeypatch.setattr(tiny_model, "_CORPUS", "too short")
    with pytest.raises(TinyModelError, match="lengthen _CORPUS"):
        tiny_model.build_vocab(CONFIG["vocab_size"])


def test_same_bytes_every_run_and_across_hash_seeds(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out, seed in ((a, "1"), (b, "2")):
        subprocess.run([sys.executable, str(SCRIPT), str(out)], check=True, capture_output=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}, cwd=tmp_path)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(["config.json", "generation_config.json", "tokenizer.json",
                            "tokenizer_config.json", "special_tokens_map.json"])
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert json.loads((a / "config.json").read_text()) == CONFIG


def test_refuses_a_non_empty_directory_and_writes_nothing(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(TinyModelError, match="not an empty directory"):
        tiny_model.write_model(out)
    assert [p.name for p in out.iterdir()] == ["weights.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left behind


def test_writes_into_an_empty_directory(tmp_path):
    out = tmp_path / "deep" / "model"
    out.mkdir(parents=True)
    tiny_model.write_model(out)
    assert tiny_model.model_dir_differences(out) == []


def test_check_names_each_difference(tmp_path):
    out = tmp_path / "model"
    tiny_model.write_model(out)
    (out / "config.json").write_text("{}")
    (out / "special_tokens_map.json").unlink()
    (out / "extra.txt").write_text("x")
    assert tiny_model.model_dir_differences(out) == [
        "special_tokens_map.json: missing",
        "extra.txt: not written by the generator",
        "config.json: content differs from the generator's",
    ]
    result = subprocess.run([sys.executable, str(SCRIPT), "--check", str(out)], capture_output=True, text=True)
    assert result.returncode == 1
    assert "config.json: content differs" in result.stderr


def test_cli_exit_codes(tmp_path):
    out = tmp_path / "m"
    assert subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True).returncode == 0
    assert subprocess.run([sys.executable, str(SCRIPT), "--check", str(out)], capture_output=True).returncode == 0
    again = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True)
    assert again.returncode == 1 and "remove it or choose another" in again.stderr


def test_module_is_stdlib_only():
    # dsa_image.core.status, the exit codes and the exception root, is stdlib only itself (test_status).
    tree = ast.parse((REPO / "dsa_image" / "build" / "tiny_model.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported |= {node.module} if node.module != "dsa_image.core" else {f"dsa_image.core.{a.name}" for a in node.names}
    assert {n.split(".")[0] for n in imported - {"dsa_image.core.status"}} - set(sys.stdlib_module_names) == set()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "tiny-glm5"
    tiny_model.write_model(out)
    return out


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_tokenizers_loads_it_with_vocab_size_tokens(model_dir):
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is in the dev lock")
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == CONFIG["vocab_size"]
    text = "Sparse attention: the indexer picks 2048 keys. Ünïcödé 你好 🙂"
    assert tok.decode(tok.encode(text).ids) == text


def test_transformers_loads_config_and_tokenizer_offline(model_dir, offline):
    transformers = pytest.importorskip("transformers", reason="transformers is in the dev lock")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "glm_moe_dsa"
    assert (config.vocab_size, config.index_topk, config.kv_lora_rank) == (1024, 2048, 512)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert len(tok) == config.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    text = "def main(argv): return 0  # GLM-5 on sm_120, 3000 tokens"
    ids = tok.encode(text)
    assert all(0 <= i < config.vocab_size for i in ids)
    assert tok.decode(ids) == text
    # Every id decodes to something: an id the tokenizer does not know decodes to "".
    assert all(tok.decode([i]) != "" for i in range(len(tiny_model.SPECIAL_TOKENS), config.vocab_size))


def test_chat_template_renders_glm_turns(model_dir, offline):
    transformers = pytest.importorskip("transformers", reason="transformers is in the dev lock")
    pytest.importorskip("jinja2", reason="jinja2 (chat templates) is in the dev lock")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[:3] == [0, 3, 4]  # [gMASK] <sop> <|system|>: special tokens, not split into bytes
    with pytest.raises(Exception, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_mtp_option_adds_one_mtp_layer_and_leaves_the_default_alone():
    assert {k: v for k, v in tiny_model.MTP_CONFIG.items() if CONFIG.get(k) != v} == {"num_nextn_predict_layers": 1}
    assert CONFIG["num_nextn_predict_layers"] == 0  # the image's model: no MTP layer
    assert tiny_model.kernel_shape_problems(tiny_model.MTP_CONFIG) == []
    default, mtp = tiny_model.model_files(), tiny_model.model_files(tiny_model.MTP_CONFIG)
    assert [name for name in default if default[name] != mtp[name]] == ["config.json"]


def test_mtp_model_directory_is_checked_against_its_own_config(tmp_path):
    out = tmp_path / "tiny-glm5-mtp"
    tiny_model.write_model(out, tiny_model.MTP_CONFIG)
    assert tiny_model.model_dir_differences(out, tiny_model.MTP_CONFIG) == []
    assert tiny_model.model_dir_differences(out) == ["config.json: content differs from the generator's"]
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_transformers_loads_the_mtp_config(tmp_path, offline):
    transformers = pytest.importorskip("transformers", reason="transformers is in the dev lock")
    out = tmp_path / "tiny-glm5-mtp"
    tiny_model.write_model(out, tiny_model.MTP_CONFIG)
    assert transformers.AutoConfig.from_pretrained(out).num_nextn_predict_layers == 1


def test_the_tiny_model_stage_copies_every_module_of_ours_the_script_imports():
    """The Dockerfile's tiny-model stage copies the writer file by file; a module missing there
    fails only the image build."""
    from test_image_tree import closure, copied

    dockerfile = (REPO / "Dockerfile").read_text()
    stage = dockerfile.split("FROM base AS tiny-model\n", 1)[1].split("\nFROM ", 1)[0]
    files, scripts = copied(stage)
    script = REPO / "scripts" / "make_tiny_model.py"
    assert scripts == {script}
    needed = closure({script}) - {script}
    assert REPO / "dsa_image" / "core" / "status.py" in needed
    assert needed <= files, sorted(str(p.relative_to(REPO)) for p in needed - files)
