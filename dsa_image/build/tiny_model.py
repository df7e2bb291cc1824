"""A tiny GLM-5 (GlmMoeDsaForCausalLM) model directory, made offline: config + tokenizer, no weights.

Served with `--load-format dummy` (random weights), it exercises every kernel of the real
model (sparse MLA, the DSA indexer, MoE) at about 83M parameters. The image embeds it as the
model it serves when started without arguments; `scripts/make_tiny_model.py` regenerates it.

Stdlib only: this runs in the Docker build with Debian's python and no network. Every file is
a pure function of the data below, so two runs write the same bytes.

The tokenizer is byte-level BPE written as a `tokenizers` JSON by hand: 8 GLM-style special
tokens, the 256 byte tokens, then merges learned from `_CORPUS` until the vocabulary holds
exactly `vocab_size` tokens. Its size must equal `vocab_size`: vLLM detokenizes ids the
tokenizer does not know as empty text. A vocabulary larger than the corpus's merges (GLM-5's
154,880: dsa_image/build/realwidth_model.py) is filled after them with plain tokens `fill_token(i)`,
each its own text, which no merge makes (a prompt of token ids reaches them; encoded text never).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterator

from dsa_image.core import status

# The tiny GLM-5 config (vendored as tests/data/tiny-glm5-config.json): it fits every kernel-imposed
# shape below. Key order is kept as written so the file reads like the reference.
CONFIG: dict = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "dtype": "bfloat16",
    "vocab_size": 1024,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 512,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}

# The same model with one MTP (next-token prediction) layer, model.layers.4: what a scaled-down
# serving recipe with MTP speculative decoding serves. An option, not the default: the image's
# built-in model and the validated runs (docs/validation) are CONFIG, byte for byte.
MTP_CONFIG: dict = {**CONFIG, "num_nextn_predict_layers": 1}

# GLM-style special tokens, ids 0..7. bos/eos/pad are 0/1/2 as in CONFIG.
BOS, EOS, PAD = "[gMASK]", "<|endoftext|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
CHAT_ROLES = ("system", "user", "assistant", "observation")
# A chat turn ends where the next role token starts, as in GLM: generation stops on eos and on
# the tokens that open the user's or the tool's next turn.
GENERATION_EOS_IDS = [1, SPECIAL_TOKENS.index("<|user|>"), SPECIAL_TOKENS.index("<|observation|>")]

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'observation'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Text the merges are learned from. Any text works (merges only change how text splits into
# tokens); this one is long enough to give the merges that fill the vocabulary.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model with random weights still runs
every kernel of the real one: the sparse attention, the lightning indexer that picks the top
two thousand and forty eight keys for each query, the mixture of experts with its shared
expert and its router, the rotary position embedding and the normalization layers.
Sparse attention reads only the keys the indexer selects. The indexer scores every key of a
prefill longer than its top-k budget; shorter prompts take the dense path. That is why a smoke
test sends a long prompt as well as a short one, and why it compares two greedy answers token
for token: the same request must give the same tokens, whatever the batch or the schedule.
Serving a model means loading its configuration, building its tokenizer, allocating the cache
of keys and values, compiling kernels for the graphics processor, capturing graphs, and then
answering requests over HTTP: completions, chat completions, streaming events that end with a
final marker, the list of models, the health endpoint, the tokenizer endpoint and metrics.
Engineers write tests that can fail, measure before they claim, and keep one source of truth
for every version they pin. They record why a decision was taken, what was expected, what was
found and what to do next. Reproducible builds give the same bytes from the same inputs; a
receipt names every file that was changed and the hash of the file it replaced.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192 65536.
Punctuation and code: () [] {} <> == != <= >= -> => :: ... "quoted" 'single' `code`;
def main(argv): return 0 if ok else 1 # comment
for i in range(10): print(i, end=", ")
{"model": "glm-5", "prompt": "Hello", "max_tokens": 16, "temperature": 0.0, "stream": true}
User: What is the capital of France? Assistant: Paris is the capital of France.
User: Write a haiku about autumn. Assistant: Leaves fall on the pond, quiet ripples carry them,
the evening grows cold.
System: You are a helpful assistant. Answer briefly and precisely, in plain words.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday; January, February, March,
April, May, June, July, August, September, October, November and December.
Mathematics, physics, chemistry, biology, history, geography, literature, music, painting,
architecture, philosophy, economics, medicine, engineering and computer science.
"""

# GPT-2's pre-tokenizer pattern (what the `tokenizers` ByteLevel pre-tokenizer applies), with
# \p{L} / \p{N} narrowed to ASCII: the corpus is ASCII, so the words found are the same.
_WORD = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")


class TinyModelError(status.DsaImageError):
    """The config breaks a kernel-imposed shape, or a model directory is not what we write."""


def kernel_shape_problems(config: dict) -> list[str]:
    """Every way `config` breaks the shapes vLLM 0.24.0's GLM-5 kernels impose (empty: fits).

    Sources: docs/decisions.md, "Kernel-imposed shapes".
    """
    problems = []

    def need(key: str, ok, expected: str) -> None:
        value = config.get(key)
        if not ok(value):
            problems.append(f"{key} = {value!r}, expected {expected}")

    need("architectures", lambda v: v == ["GlmMoeDsaForCausalLM"], '["GlmMoeDsaForCausalLM"]')
    need("model_type", lambda v: v == "glm_moe_dsa", '"glm_moe_dsa"')
    # MLA head size 576 = 512 + 64: the sparse MLA kernels are built for it alone.
    need("kv_lora_rank", lambda v: v == 512, "512 (sparse MLA head size 576)")
    need("qk_rope_head_dim", lambda v: v == 64, "64 (sparse MLA head size 576)")
    need("index_head_dim", lambda v: v == 128, "128 (DeepGEMM indexer kernels)")
    need("index_n_heads", lambda v: v in (32, 64), "32 or 64 (DeepGEMM indexer kernels)")
    need("index_topk", lambda v: v == 2048, "2048 (FlashInfer sparse MLA on SM120)")
    need("qk_nope_head_dim", lambda v: isinstance(v, int) and 128 <= v <= 192,
         "in [128, 192] (FlashInfer sparse MLA on SM100)")
    # The indexer only scores prefills longer than index_topk: a model that cannot hold such a
    # prompt never exercises it.
    topk = config.get("index_topk")
    need("max_position_embeddings", lambda v: isinstance(v, int) and isinstance(topk, int) and v > topk,
         f"> index_topk ({topk}) so a prompt can reach the indexer")
    vocab = config.get("vocab_size")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        need(key, lambda v: isinstance(v, int) and isinstance(vocab, int) and 0 <= v < vocab,
             f"an id below vocab_size ({vocab})")
    return problems


def validate_config(config: dict) -> None:
    problems = kernel_shape_problems(config)
    if problems:
        raise TinyModelError("config does not fit the GLM-5 kernels: " + "; ".join(problems))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = {}
    extra = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def iter_merges(corpus: str) -> Iterator[tuple[str, str]]:
    """BPE merges over `corpus`, most frequent pair first, ties broken by the pair's text."""
    alphabet = bytes_to_unicode()
    word_counts = Counter(_WORD.findall(corpus))
    words = {tuple(alphabet[b] for b in w.encode("utf-8")): n for w, n in word_counts.items()}
    while True:
        pairs: Counter = Counter()
        for symbols, n in words.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                pairs[pair] += n
        if not pairs:
            return
        best = min(pairs, key=lambda p: (-pairs[p], p))
        yield best
        words = {_merge_pair(symbols, best): n for symbols, n in words.items()}


def _merge_pair(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def fill_token(index: int, alphabet: dict[int, str] | None = None) -> str:
    """The `index`-th filler token: the text " tok<index>" in the byte-level alphabet."""
    alphabet = alphabet or bytes_to_unicode()
    return "".join(alphabet[b] for b in f" tok{index}".encode())


def build_vocab(vocab_size: int, fill: bool = False) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Specials, then the 256 byte tokens, then merged tokens, then (with `fill`, once the
    corpus has no merge left) filler tokens: exactly `vocab_size` entries."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    merges = []
    # A merge may rebuild a token the vocab already has (same text from different pairs): it
    # adds no id, so learn more until the vocabulary is full.
    for left, right in iter_merges(_CORPUS):
        if len(vocab) == vocab_size:
            break
        merges.append((left, right))
        vocab.setdefault(left + right, len(vocab))
    index, alphabet = 0, bytes_to_unicode()
    while fill and len(vocab) < vocab_size:
        vocab.setdefault(fill_token(index, alphabet), len(vocab))  # a merge may have made the text already
        index += 1
    if len(vocab) != vocab_size:
        raise TinyModelError(f"vocabulary reached {len(vocab)} tokens, {vocab_size} needed: lengthen _CORPUS")
    return vocab, merges


def tokenizer_json(vocab_size: int, fill: bool = False) -> dict:
    vocab, merges = build_vocab(vocab_size, fill)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, token in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[left, right] for left, right in merges],
        },
    }


def tokenizer_config(config: dict) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[config["bos_token_id"]],
        "eos_token": SPECIAL_TOKENS[config["eos_token_id"]],
        "pad_token": SPECIAL_TOKENS[config["pad_token_id"]],
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, token in enumerate(SPECIAL_TOKENS)
        },
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map(config: dict) -> dict:
    return {
        "bos_token": SPECIAL_TOKENS[config["bos_token_id"]],
        "eos_token": SPECIAL_TOKENS[config["eos_token_id"]],
        "pad_token": SPECIAL_TOKENS[config["pad_token_id"]],
    }


def generation_config(config: dict) -> dict:
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": GENERATION_EOS_IDS,
        "pad_token_id": config["pad_token_id"],
    }


def model_files(config: dict = CONFIG, fill_vocab: bool = False) -> dict[str, bytes]:
    """File name -> exact bytes of the model directory (`fill_vocab`: see build_vocab)."""
    validate_config(config)
    documents = {
        "config.json": config,
        "generation_config.json": generation_config(config),
        "tokenizer.json": tokenizer_json(config["vocab_size"], fill_vocab),
        "tokenizer_config.json": tokenizer_config(config),
        "special_tokens_map.json": special_tokens_map(config),
    }
    return {name: (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
            for name, doc in documents.items()}


def write_model(out_dir: Path, config: dict = CONFIG) -> list[Path]:
    """Write the model directory; nothing is left half-written if anything fails.

    `out_dir` must not exist or be empty: an existing model is never overwritten silently.
    """
    return write_files(out_dir, model_files(config))


def write_files(out_dir: Path, files: dict[str, bytes]) -> list[Path]:
    """write_model's writer, for any model directory's files (name -> bytes)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise TinyModelError(f"{out_dir} exists and is not an empty directory: remove it or choose another")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        staging.chmod(0o755)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [out_dir / name for name in files]


def model_dir_differences(model_dir: Path, config: dict = CONFIG) -> list[str]:
    """How `model_dir` differs from what `write_model(model_dir, config)` writes (empty: identical)."""
    return files_differences(model_dir, model_files(config))


def files_differences(model_dir: Path, expected: dict[str, bytes]) -> list[str]:
    """How `model_dir` differs from the files `expected` (name -> bytes; empty: identical)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return [f"{model_dir}: no such directory"]
    found = {p.name for p in model_dir.iterdir()}
    differences = [f"{name}: missing" for name in sorted(expected.keys() - found)]
    differences += [f"{name}: not written by the generator" for name in sorted(found - expected.keys())]
    for name in sorted(expected.keys() & found):
        if (model_dir / name).read_bytes() != expected[name]:
            differences.append(f"{name}: content differs from the generator's")
    return differences
