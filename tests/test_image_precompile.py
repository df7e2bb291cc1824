"""In the image's test stage: the FlashInfer modules the precompile stage built (copied where the
runtime has them) load as built, and each way one goes stale is caught, not rebuilt quietly.

Needs the real FlashInfer, ninja, nvcc's cuobjdump and the artefacts: it runs in the image
(Dockerfile, test stage) and skips elsewhere."""

import copy
import importlib.util
import json
import os
from pathlib import Path

import pytest

from dsa_image.build import precompile

MANIFEST = Path("/opt/dsa-image/precompiled.json")
pytestmark = pytest.mark.skipif(
    not MANIFEST.is_file() or importlib.util.find_spec("flashinfer") is None,
    reason=f"needs the image: {MANIFEST} (the precompile stage's manifest) and FlashInfer installed")


@pytest.fixture(scope="module")
def doc():
    doc = json.loads(MANIFEST.read_text())
    if doc["skipped"]:
        pytest.skip(f"this image ships none: {doc['skipped']}")
    return doc


def _first(doc: dict) -> dict:
    """The manifest with its first artefact only: each stale case costs a FlashInfer import."""
    return copy.deepcopy({**doc, "artefacts": doc["artefacts"][:1]})


def _env(**extra) -> dict:
    return {**os.environ, "FLASHINFER_WORKSPACE_BASE": "/home/vllm", **extra}


def test_every_shipped_module_loads_as_built(doc):
    for art in doc["artefacts"]:
        major, minor = art["capability"].split(".")
        assert art["arch"].startswith(f"sm_{major}{minor}") and f"/{major}{minor}" in art["path"]
    assert precompile.check_doc(doc, _env()) == []


def test_a_library_other_than_the_one_built_is_caught(doc):
    tampered = _first(doc)
    tampered["artefacts"][0]["sha256"] = "0" * 64
    problems = precompile.check_doc(tampered, _env())
    assert len(problems) == 1 and "not the library that was built" in problems[0]


def test_a_changed_compiler_command_is_caught(doc):
    # FLASHINFER_NVCC_THREADS changes nvcc's --threads flag: FlashInfer would rewrite
    # build.ninja and ninja would rebuild every object.
    problems = precompile.check_doc(_first(doc), _env(FLASHINFER_NVCC_THREADS="2"))
    assert any("build.ninja FlashInfer writes now differs" in p for p in problems), problems


def test_a_source_newer_than_its_object_is_caught(doc):
    art = doc["artefacts"][0]
    import flashinfer.jit.env as jit_env

    source = jit_env.FLASHINFER_CSRC_DIR / "renorm.cu"
    before = source.stat()
    try:
        os.utime(source, (before.st_atime, before.st_mtime + 10 ** 6))
        problems = precompile.check_doc(_first(doc), _env())
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert any("ninja would rebuild" in p for p in problems), problems
    assert precompile.check_doc(_first(doc), _env()) == [], f"{art['path']} stale after restoring {source}"
