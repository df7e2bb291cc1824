"""Models and prompts for the harnesses: a copy of a model that allows a longer context, prompt
token ids drawn reproducibly from a model's vocabulary."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path


def long_context_model(source: Path, target: Path, max_len: int) -> Path:
    """A copy of a model directory that allows `max_len` tokens.

    vLLM caps max_model_len at config.json's max_position_embeddings and at tokenizer_config's
    model_max_length (config/model.py, _get_and_verify_max_len): raising the first alone with
    --hf-overrides still fails on the second. The rotary cache is sized from the first, so a
    position past it is never read."""
    source, target = Path(source), Path(target)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    _set_json(staging / "config.json", "max_position_embeddings", max_len)
    if (staging / "tokenizer_config.json").is_file():
        _set_json(staging / "tokenizer_config.json", "model_max_length", max_len)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


def _set_json(path: Path, key: str, value) -> None:
    doc = json.loads(path.read_text())
    doc[key] = value
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def model_prompt_ids(token_ids: list[int], length: int, seed_key: str) -> list[int]:
    """`length` ids drawn from `token_ids`; the same key gives the same prompt anywhere
    (random.Random seeds a str from its sha512, not from Python's salted hash)."""
    rng = random.Random(seed_key)
    return [rng.choice(token_ids) for _ in range(length)]


def prompt_token_ids(model_dir: str | Path) -> list[int]:
    """Ids a prompt may use: the model's vocabulary without its special tokens."""
    model = Path(model_dir)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    special: set[int] = set()
    tokenizer_config = model / "tokenizer_config.json"
    if tokenizer_config.is_file():
        special = {int(i) for i in json.loads(tokenizer_config.read_text()).get("added_tokens_decoder", {})}
    return [i for i in range(vocab) if i not in special]
