"""GLM-5 at its real width, truncated in depth: a model directory made offline for validation.

The tiny GLM-5 (tiny_model.py) runs every kernel of the real model, at shapes whose decode step is
mostly per-kernel overhead. This one has GLM-5's own shapes, so that the GPU harnesses measure the
overlay where the real model's work is: its config is GLM-5's model facts
(recipes/models/glm-5.toml: hidden 6144, 64 heads, q_lora 2048, kv_lora 512, 256 routed experts
top-8 + 1 shared, the first 3 layers dense, the indexer's 32 heads x 128 and top-k 2048, the
vocabulary of 154,880, its MTP layer), with ONE change, `CHANGED`: 4 layers instead of 78
(3 dense, 1 MoE; the MTP layer, used only when a server drafts with MTP, is a MoE layer too).
The expert count is GLM-5's. What the model facts do not carry, none of it a shape (the router's
grouping and scaling, the norm's epsilon, the rotary base, the special ids), is the tiny
model's. The generated README.md says the same, with the memory plan's weights
(dsa_image/serving/memory_plan.py): about 24.2 GiB in bf16, 42.7 GiB with the MTP layer.

Served with `--load-format dummy` (random weights). The tokenizer is the tiny model's byte-level
BPE, filled to GLM-5's vocab_size (tiny_model.build_vocab): vLLM detokenizes an id the tokenizer
does not know as empty text. Stdlib only; every file is a pure function of the repository.

    python3 scripts/make_realwidth_model.py OUT_DIR
    python3 scripts/make_realwidth_model.py --check DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsa_image.serving import memory_plan
from dsa_image.build import tiny_model
from dsa_image.core import status
from dsa_image.core.recipe import RECIPES_DIR
from dsa_image.serving.recipes import load_model

MODEL_ID = "glm-5"  # recipes/models/glm-5.toml
NAME = "glm5-realwidth"  # the directory the GPU session runner writes under its work root
DEPTH = 4
CHANGED = {"num_hidden_layers": DEPTH}
EXIT_CODES = status.epilog(
    (status.SUCCESS, "written; --check: identical"),
    (status.FAILED, "--check: the directory differs (each difference printed); else it cannot be written"),
    status.USAGE)


def facts(recipes_dir: Path = RECIPES_DIR) -> dict:
    """GLM-5's model facts: [config] with [published] applied."""
    return load_model(MODEL_ID, recipes_dir).config


def config(recipes_dir: Path = RECIPES_DIR) -> dict:
    """The tiny model's keys in its order, each with GLM-5's value where the facts have one, then
    the facts' other keys, then CHANGED."""
    glm5 = facts(recipes_dir)
    merged = {key: glm5.get(key, value) for key, value in tiny_model.CONFIG.items()}
    merged.update((key, value) for key, value in glm5.items() if key not in merged)
    return {**merged, **CHANGED}


def readme(cfg: dict, glm5: dict) -> str:
    bf16 = memory_plan.SCHEMES["bf16"]
    weights = memory_plan.checkpoint_bytes(cfg, bf16, with_mtp=False)
    with_mtp = memory_plan.checkpoint_bytes(cfg, bf16, with_mtp=True)
    changed = ", ".join(f"{key} {glm5[key]} -> {value}" for key, value in CHANGED.items())
    dense = cfg["first_k_dense_replace"]
    kept = [key for key in tiny_model.CONFIG if key not in glm5]
    return (
        f"# GLM-5 at real width, {DEPTH} layers (random weights: serve with --load-format dummy)\n\n"
        f"Written by dsa_image/build/realwidth_model.py from recipes/models/glm-5.toml. Changed from GLM-5: "
        f"{changed} ({dense} dense, {DEPTH - dense} MoE). Not changed: the width, the "
        f"{cfg['n_routed_experts']} routed experts (top {cfg['num_experts_per_tok']}, "
        f"{cfg['n_shared_experts']} shared), the indexer, the vocabulary ({cfg['vocab_size']} tokens) and the "
        f"{cfg['num_nextn_predict_layers']} MTP layer. From the tiny GLM-5, as GLM-5's facts do not carry them "
        f"(none is a shape): {', '.join(kept)}.\n\n"
        f"Weights (dsa_image/serving/memory_plan.py, bf16): {weights / memory_plan.GIB:.1f} GiB; "
        f"{with_mtp / memory_plan.GIB:.1f} GiB with the MTP layer (a server with MTP speculative decoding).\n\n"
        f"The tokenizer is the tiny model's byte-level BPE filled to vocab_size with plain tokens "
        f"(dsa_image/build/tiny_model.py, fill_token).\n")


def model_files(recipes_dir: Path = RECIPES_DIR) -> dict[str, bytes]:
    cfg = config(recipes_dir)
    return {**tiny_model.model_files(cfg, fill_vocab=True), "README.md": readme(cfg, facts(recipes_dir)).encode()}


def write_model(out_dir: Path) -> list[Path]:
    return tiny_model.write_files(out_dir, model_files())


def model_dir_differences(model_dir: Path) -> list[str]:
    return tiny_model.files_differences(model_dir, model_files())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="where to write the model (must not exist or be empty)")
    parser.add_argument("--check", action="store_true", help="compare DIR with what would be written; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        differences = model_dir_differences(args.directory)
        for line in differences:
            print(f"{args.directory}: {line}", file=sys.stderr)
        if differences:
            print("regenerate it with: python3 scripts/make_realwidth_model.py DIR", file=sys.stderr)
        return status.FAILED if differences else status.SUCCESS
    try:
        written = write_model(args.directory)
    except (tiny_model.TinyModelError, OSError) as exc:
        print(f"make_realwidth_model: {exc}", file=sys.stderr)
        return status.FAILED
    for path in written:
        print(path)
    return status.SUCCESS
