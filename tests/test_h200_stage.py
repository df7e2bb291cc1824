"""What the H200 validation stages per base (dsa_image/validation/stage.py) and the check of which
torch and CUDA libraries a site loads (dsa_image/validation/torch_libs.py); the session runner that
receives and installs the staged wheels: tests/test_gpu_session.py. No network, no GPU."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from dsa_image.build import lock, lock_parse
from dsa_image.build.lock_parse import Pin
from dsa_image.core import status
from dsa_image.core.recipe import load_recipe
from dsa_image.validation import stage, torch_libs

REPO = Path(__file__).resolve().parent.parent
OLD = load_recipe(vllm="0.24.0")
NEW = load_recipe(vllm="0.33.0")



def pin(version: str, *hashes: str) -> Pin:
    return Pin(version, frozenset(hashes or (hashlib.sha256(version.encode()).hexdigest(),)))


# --- reading the locks' dependency comments -------------------------------------------------

VIA = """\
torch==2.14.0 \\
    --hash=sha256:{h}
    # via
    #   -r recipes/requirements/vllm-0.33.0/vllm.in
    #   vllm
cuda-toolkit==13.0.3.0 \\
    --hash=sha256:{h}
    # via torch
nvidia-cublas==13.1.1.3 \\
    --hash=sha256:{h}
    # via
    #   cuda-toolkit
    #   nvidia-cudnn-cu13
nvidia-cudnn-cu13==9.24.0.43 \\
    --hash=sha256:{h}
    # via torch
numpy==2.0.0 \\
    --hash=sha256:{h}
    # via vllm
""".format(h="a" * 64)


def test_parse_via_reads_both_forms_and_leaves_out_requirement_files():
    via = lock_parse.parse_via(VIA)
    assert via["torch"] == {"vllm"}
    assert via["cuda-toolkit"] == {"torch"}
    assert via["nvidia-cublas"] == {"cuda-toolkit", "nvidia-cudnn-cu13"}
    assert set(via) == set(lock_parse.parse_lock(VIA))


def test_requirements_of_follows_the_chain_and_stops_at_other_roots():
    via = lock_parse.parse_via(VIA)
    assert lock_parse.requirements_of(via, "torch") == {"cuda-toolkit", "nvidia-cublas", "nvidia-cudnn-cu13"}
    assert stage.torch_stack(via) == {"nvidia-cublas", "nvidia-cudnn-cu13"}


# --- the selection, on small made-up pins ------------------------------------------------


def test_selection_stages_what_the_h200_lacks_and_torch_with_its_whole_cuda_set():
    pins = {"a": pin("1.0"), "b": pin("2.0"), "torch": pin("2.14.0"), "nvidia-x": pin("1"), "nvidia-y": pin("1"),
            "new": pin("0.1")}
    present = {"a": "1.0", "b": "1.9", "torch": "2.11.0+cu130", "nvidia-x": "1", "nvidia-y": "1"}
    chosen = {s.name: s for s in stage.selection(pins, present, stack={"nvidia-x"})}
    assert set(chosen) == {"b", "torch", "new", "nvidia-x"}  # nvidia-y: not one of torch's libraries
    assert chosen["b"].why == "the H200 has 1.9" and chosen["new"].why == "not on the H200"
    # torch's library the H200 has at the lock's version: listed, not carried (dist_copy copies it)
    assert chosen["nvidia-x"].why == stage.COPIED and not chosen["nvidia-x"].carried
    assert all(chosen[n].carried for n in ("b", "torch", "new"))
    assert chosen["torch"].hashes == pins["torch"].hashes  # the lock's hashes travel with each pin


def test_the_toolkits_wheels_travel_even_where_the_h200_has_them():
    pins = {"nvidia-cuda-nvcc": pin("13.0.88"), "cuda-python": pin("13.4.4")}
    present = {"nvidia-cuda-nvcc": "13.0.88", "cuda-python": "13.4.4"}
    assert stage.toolkit_wheels(NEW) == {lock_parse.normalize(p.split("==")[0]) for p in NEW.cuda_toolkit} - {"cuda-python"}
    chosen = stage.selection(pins, present, set(), always=stage.toolkit_wheels(NEW))
    assert [(s.name, s.why) for s in chosen] == [("nvidia-cuda-nvcc", "on the H200, staged for the toolchain's CUDA home")]


def test_torch_of_the_h200_counts_as_the_lock_pin_without_its_local_label():
    pins = {"torch": pin("2.11.0"), "nvidia-x": pin("1")}
    assert stage.selection(pins, {"torch": "2.11.0+cu130", "nvidia-x": "1"}, {"nvidia-x"}) == []
    assert stage.has({"x": "13.0.3"}, "x", "13.0.3.0")  # PEP 440: trailing .0 is the same release
    assert not stage.has({"x": "2.11.1"}, "x", "2.11.0")


# --- the H200's environment, as the inventory phase recorded it ------------------------------

RECORD = stage.read_record(stage.H200_RECORD)


def test_the_0_24_selection_brings_the_locks_versions_of_what_the_h200_lacks_and_not_its_torch():
    pins = stage.needed(OLD)
    staged = {s.name: s for s in stage.plan(OLD, RECORD)}
    assert {"vllm", "b12x", "ray", "nvidia-cutlass-dsl", "nvidia-cuda-nvcc"} <= set(staged)
    assert "torch" not in staged and "triton" not in staged  # the H200's are the lock's
    # A release the H200 has at another version comes at the lock's: the image's set, not the H200's.
    assert RECORD["transformers"] != pins["transformers"].version
    assert staged["transformers"].why == f"the H200 has {RECORD['transformers']}"
    assert all(s.version == pins[n].version and s.hashes == pins[n].hashes for n, s in staged.items())
    assert {n for n, p in pins.items() if not stage.has(RECORD, n, p.version)} <= set(staged)


def test_the_0_33_selection_brings_torch_its_cuda_set_vllm_b12x_the_toolkit_and_ray():
    pins = stage.needed(NEW)
    staged = {s.name: s for s in stage.plan(NEW, RECORD)}
    assert {"torch", "triton", "vllm", "b12x", "ray"} <= set(staged)
    assert staged["torch"].version == "2.14.0" and staged["b12x"].version == NEW.get("b12x.version")
    via = lock_parse.parse_via((REPO / lock.common_lock(NEW, "amd64")).read_text())
    assert stage.torch_stack(via) <= set(staged)
    assert {"nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cufft"} <= set(staged)
    # Carried: what the H200 lacks and the toolkit; copied from the H200: the rest of torch's set.
    copied = {n for n, s in staged.items() if not s.carried}
    assert copied == {n for n in stage.torch_stack(via) - stage.toolkit_wheels(NEW) if stage.has(RECORD, n, pins[n].version)}
    assert "nvidia-cufft" in copied and "nvidia-cublas" not in copied
    assert {lock_parse.normalize(p.split("==")[0]) for p in NEW.cuda_toolkit if p.startswith("nvidia-")} <= set(staged)
    same = [n for n, p in pins.items() if stage.has(RECORD, n, p.version) and n not in stage.torch_stack(via)
            and n not in stage.toolkit_wheels(NEW)]
    assert same and not set(same) & set(staged)  # what the H200 has at the lock's version stays its own
    assert all(s.version == pins[n].version and s.hashes == pins[n].hashes for n, s in staged.items())


def test_needed_refuses_an_extras_lock_that_moves_a_common_pin(monkeypatch):
    real = stage._read_lock

    def moved(path):
        text = real(path)
        return text.replace("numpy==", "numpy==0.0.1.dev0+") if "sm120" in str(path) else text

    monkeypatch.setattr(stage, "_read_lock", moved)
    with pytest.raises(stage.StageError, match="only add to the common lock, but moves numpy") as caught:
        stage.needed(NEW)
    assert caught.value.exit_code == status.DRIFT  # pinned not as staging expects: re-lock


# --- download, verify and bundle --------------------------------------------------------------


def wheel(directory: Path, name: str, version: str, content: bytes) -> Path:
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    path.write_bytes(content)
    return path


def test_a_downloaded_wheel_must_carry_a_hash_of_the_lock(tmp_path):
    good = wheel(tmp_path, "foo", "1.0", b"locked")
    staged = stage.Staged("foo", "1.0", frozenset({hashlib.sha256(b"locked").hexdigest()}), "")
    assert stage.verified_wheel(tmp_path, staged) == good
    good.write_bytes(b"tampered")
    with pytest.raises(stage.StageError, match=r"one wheel of foo==1.0 with a sha256 of the lock's 1, found 0"):
        stage.verified_wheel(tmp_path, staged)


def test_download_fails_closed_when_pip_leaves_a_file_the_lock_does_not_know(tmp_path, monkeypatch):
    staged = [stage.Staged("foo", "1.0", frozenset({"0" * 64}), "")]

    def fake_pip(argv, check):
        requirements = Path(argv[argv.index("-r") + 1]).read_text()
        assert requirements == f"foo==1.0 --hash=sha256:{'0' * 64}\n" and "--require-hashes" in argv
        wheel(Path(argv[argv.index("-d") + 1]), "foo", "1.0", b"not what was locked")

    monkeypatch.setattr(stage.subprocess, "run", fake_pip)
    with pytest.raises(stage.StageError, match="foo==1.0"):
        stage.download(staged, NEW, tmp_path / "cache")


def test_the_bundle_reassembles_from_its_parts_and_lists_what_it_holds(tmp_path):
    files = {n: wheel(tmp_path, n, "1.0", os.urandom(3000)) for n in ("foo", "bar")}
    staged = [stage.Staged(n, "1.0", frozenset(), "not on the H200") for n in sorted(files)]
    staged.append(stage.Staged("nvidia-z", "2.0", frozenset(), stage.COPIED, carried=False))  # no file, not in the tar
    out = tmp_path / "out"
    (out / "bundle.tar.part99").parent.mkdir()
    (out / "bundle.tar.part99").write_bytes(b"stale")
    parts = stage.write_stage(staged, files, out, part_bytes=4096)
    assert len(parts.paths) > 1 and sorted(out.glob("bundle.tar.part*")) == parts.paths
    bundle = b"".join(p.read_bytes() for p in parts.paths)
    sums = dict(reversed(line.split("  ")) for line in (out / "SHA256SUMS").read_text().splitlines())
    assert sums["bundle.tar"] == hashlib.sha256(bundle).hexdigest() and parts.size == len(bundle)
    assert all(sums[p.name] == hashlib.sha256(p.read_bytes()).hexdigest() for p in parts.paths)
    assert len(sums) == len(parts.paths) + 2
    assert sums["selection.txt"] == hashlib.sha256((out / "selection.txt").read_bytes()).hexdigest()
    (tmp_path / "bundle.tar").write_bytes(bundle)
    with tarfile.open(tmp_path / "bundle.tar") as tar:
        assert sorted(tar.getnames()) == sorted(p.name for p in files.values())
    assert stage.parse_selection((out / "selection.txt").read_text()) == {
        **{n: ("1.0", files[n].name) for n in files}, "nvidia-z": ("2.0", stage.FROM_H200)}


def test_pip_gets_every_manylinux_tag_up_to_the_h200_glibc():
    args = stage.platform_args()
    tags = args[5::2]
    assert "manylinux_2_31_x86_64" in tags and "manylinux_2_28_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_32_x86_64" not in tags
    assert args[:4] == ["--python-version", "3.12", "--implementation", "cp"]


# --- on the device: the inventory check -------------------------------------------------


def test_check_freeze_passes_when_the_bundle_and_the_h200_cover_the_base(monkeypatch):
    monkeypatch.setattr(stage, "unsupported", lambda filenames: [])
    staged = {s.name: (s.version, f"{s.name}.whl") for s in stage.plan(NEW, RECORD)}
    report, problems = stage.check_freeze(NEW, RECORD, RECORD, staged)
    assert problems == []
    assert report[0] == f"this H200: {len(RECORD)} packages; the same as the record staging used"


def test_check_freeze_names_how_the_h200_changed_and_what_is_then_missing(monkeypatch):
    monkeypatch.setattr(stage, "unsupported", lambda filenames: [])
    staged = {s.name: (s.version, f"{s.name}.whl") for s in stage.plan(NEW, RECORD)}
    lost = next(n for n, p in stage.needed(NEW).items() if n not in staged)  # staging counted on the H200's
    real = {n: v for n, v in RECORD.items() if n != lost} | {"pyyaml": "0.1", "extra-thing": "1.0"}
    report, problems = stage.check_freeze(NEW, real, RECORD, staged)
    assert report[0] == f"this H200: {len(real)} packages; 3 differ from the record staging used:"
    assert f"  {lost}: recorded {RECORD[lost]}, not here" in report
    assert "  extra-thing: not recorded, here 1.0" in report
    assert f"  pyyaml: recorded {RECORD['pyyaml']}, here 0.1" in report
    # pyyaml comes in the bundle at the lock's version: only the lost pin is a problem.
    assert [p.split(":")[0] for p in problems] == [f"{lost}=={stage.needed(NEW)[lost].version}"]


def test_a_pin_left_to_the_h200s_copy_is_uncovered_where_the_h200_lacks_it(monkeypatch):
    monkeypatch.setattr(stage, "unsupported", lambda filenames: [])
    staged = {s.name: (s.version, f"{s.name}.whl" if s.carried else stage.FROM_H200) for s in stage.plan(NEW, RECORD)}
    report, problems = stage.check_freeze(NEW, RECORD, RECORD, staged)
    copied = sorted(n for n, (_, f) in staged.items() if f == stage.FROM_H200)
    assert problems == [] and copied and f"{len(copied)} copied from the H200's venv into the site" in report[-1]
    real = {n: v for n, v in RECORD.items() if n != copied[0]}
    _, problems = stage.check_freeze(NEW, real, RECORD, staged)
    assert [p.split(":")[0] for p in problems] == [f"{copied[0]}=={staged[copied[0]][0]}"]


def test_a_staged_wheel_this_python_refuses_is_a_problem():
    assert stage.unsupported(["foo-1.0-py3-none-any.whl", "bar-1.0-cp312-cp312-manylinux_2_99_x86_64.whl"]) == [
        "bar-1.0-cp312-cp312-manylinux_2_99_x86_64.whl"]


def test_parse_freeze_refuses_a_line_that_is_not_a_pin():
    assert stage.parse_freeze("# recorded ...\nFoo_Bar==1.0\n\n", "f") == {"foo-bar": "1.0"}
    with pytest.raises(stage.StageError, match="f:2: expected `name==version`") as caught:
        stage.parse_freeze("a==1\nb @ file:///x\n", "f")
    assert caught.value.exit_code == status.USAGE  # a malformed file


def test_the_command_line_plans_without_downloading(capsys):
    assert stage.main(["--vllm", "0.33.0", "--plan"]) == 0
    out = capsys.readouterr().out
    count = len(stage.plan(NEW, RECORD))
    carried = sum(s.carried for s in stage.plan(NEW, RECORD))
    assert out.startswith(f"vLLM 0.33.0: {carried} wheels to stage and {count - carried} to copy from the H200's "
                          "installation, against the H200's recorded `pip list` (recipes/hosts/h200-pip-freeze.txt)")
    assert "torch==2.14.0  # the H200 has 2.11.0" in out


def test_check_freeze_on_the_command_line_exits_1_and_says_how_to_restage(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(stage, "unsupported", lambda filenames: [])
    freeze = tmp_path / "h200-pip-freeze.txt"
    freeze.write_text("numpy==1.0\n")
    selection = tmp_path / "selection.txt"
    selection.write_text("vllm==0.33.0  vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl  not on the H200\n")
    assert stage.main(["--vllm", "0.33.0", "--check-freeze", str(freeze), "--staged", str(selection)]) == status.FAILED
    err = capsys.readouterr().err
    assert "--vllm 0.33.0 --h200-freeze h200-pip-freeze.txt" in err and "torch==2.14.0" in err


def test_a_missing_record_is_refused_with_how_to_make_one(tmp_path, capsys):
    assert stage.main(["--vllm", "0.33.0", "--plan", "--h200-freeze", str(tmp_path / "none.txt")]) == status.REFUSED
    assert "the inventory phase (`python3 scripts/gpu_validation.py inventory`) writes it" in capsys.readouterr().err


# --- which torch and CUDA libraries a site loads ------------------------------------------

MAPS = """\
7f00-7f01 r-xp 00000000 08:01 1 /tmp/site/torch/lib/libtorch_cuda.so
7f01-7f02 r--p 00000000 08:01 1 /tmp/site/torch/lib/libtorch_cuda.so
7f02-7f03 r-xp 00000000 08:01 2 /tmp/site/nvidia/cu13/lib/libcublas.so.13
7f03-7f04 r-xp 00000000 08:01 3 /tmp/site/nvidia/cu13/lib/libcublasLt.so.13
7f04-7f05 r-xp 00000000 08:01 4 /tmp/site/nvidia/cudnn/lib/libcudnn.so.9
7f05-7f06 r-xp 00000000 08:01 5 /usr/lib/x86_64-linux-gnu/libcuda.so.1
7f06-7f07 rw-p 00000000 00:00 0 [heap]
7f06-7f07 r-xp 00000000 08:01 7 /usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.1
7f07-7f08 r-xp 00000000 08:01 6 /venv/site-packages/nvidia/cu13/lib/libcufft.so.12
"""


def site_with_torch(tmp_path: Path) -> Path:
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text("")
    return tmp_path / "site"


def test_mapped_libraries_lists_each_shared_object_once():
    libs = torch_libs.mapped_libraries(MAPS)
    assert libs[0] == "/tmp/site/torch/lib/libtorch_cuda.so" and len(libs) == len(set(libs)) == 7
    assert torch_libs.cuda_libraries(libs) == [
        "/tmp/site/nvidia/cu13/lib/libcublas.so.13", "/tmp/site/nvidia/cu13/lib/libcublasLt.so.13",
        "/tmp/site/nvidia/cudnn/lib/libcudnn.so.9", "/venv/site-packages/nvidia/cu13/lib/libcufft.so.12"]


def test_a_site_with_torch_must_provide_every_cuda_library(tmp_path):
    site = site_with_torch(tmp_path)
    libs = [str(site / "nvidia/cu13/lib/libcublas.so.13"), str(site / "nvidia/cudnn/lib/libcudnn.so.9")]
    assert torch_libs.evaluate(str(site / "torch/__init__.py"), "2.14.0", "2.14.0", site, libs) == ([], [])
    problems, _ = torch_libs.evaluate(str(site / "torch/__init__.py"), "2.14.0", "2.14.0", site,
                                      libs + ["/venv/site-packages/nvidia/cu13/lib/libcufft.so.12"])
    assert problems == [f"libcufft.so.12: expected from {site} (torch's tree), mapped from "
                        "/venv/site-packages/nvidia/cu13/lib/libcufft.so.12"]


def test_a_site_with_torch_must_shadow_the_h200s_torch(tmp_path):
    site = site_with_torch(tmp_path)
    venv = "/venv/site-packages"
    libs = [f"{venv}/nvidia/cu13/lib/libcublas.so.13", f"{venv}/nvidia/cudnn/lib/libcudnn.so.9"]
    problems, _ = torch_libs.evaluate(f"{venv}/torch/__init__.py", "2.11.0+cu130", "2.14.0", site, libs)
    assert problems[0].startswith(f"torch: expected {site}/torch") and "put" in problems[0]
    assert any("expected 2.14.0 (the base's lock), found 2.11.0+cu130" in p for p in problems)


def test_with_the_h200s_torch_cublas_and_cudnn_come_from_its_venv_and_other_copies_are_noted(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    venv = "/venv/site-packages"
    libs = [f"{venv}/nvidia/cu13/lib/libcublas.so.13", f"{venv}/nvidia/cudnn/lib/libcudnn.so.9",
            f"{site}/nvidia/cu13/lib/libcudart.so.13"]
    problems, notes = torch_libs.evaluate(f"{venv}/torch/__init__.py", "2.11.0+cu130", "2.11.0", site, libs)
    assert problems == [] and notes == [f"libcudart.so.13: also mapped from {site}/nvidia/cu13/lib/libcudart.so.13 "
                                        "(torch is the H200's; the site holds this library too)"]
    problems, _ = torch_libs.evaluate(f"{venv}/torch/__init__.py", "2.11.0+cu130", "2.11.0", site,
                                      [f"{site}/nvidia/cu13/lib/libcublas.so.13", libs[1]])
    assert problems == [f"libcublas.so.13: expected from {venv} (torch's tree), mapped from "
                        f"{site}/nvidia/cu13/lib/libcublas.so.13"]


def test_cublas_and_cudnn_must_have_been_loaded(tmp_path):
    site = site_with_torch(tmp_path)
    problems, _ = torch_libs.evaluate(str(site / "torch/__init__.py"), "2.14.0", "2.14.0", site,
                                      [str(site / "nvidia/cu13/lib/libcublas.so.13")])
    assert problems == [f"libcudnn: not mapped after a matmul and a convolution on the GPU; expected it from {site}"]


# --- the part size a device call leaves room for -------------------------------------------


def test_part_size_is_what_the_carry_leaves_beside_the_repository():
    # A 7 MB repository: 60 MB parts were refused, so parts shrink to fit the limit with headroom.
    size = stage.part_bytes(7_065_625)
    assert size % 1_000_000 == 0
    assert size + 7_065_625 + stage.CARRY_HEADROOM <= stage.CARRY_LIMIT
    assert stage.part_bytes(0) > size


def test_a_repository_too_large_for_a_useful_part_is_refused():
    with pytest.raises(stage.StageError, match="leaving .* MB for a part"):
        stage.part_bytes(stage.CARRY_LIMIT - stage.CARRY_HEADROOM - 10_000_000)


def test_repository_bytes_counts_tracked_and_untracked_files_but_not_ignored_ones(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text(".stage/\n")
    (tmp_path / "tracked").write_bytes(b"x" * 1000)
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked", ".gitignore"], check=True)
    (tmp_path / "untracked").write_bytes(b"y" * 300)
    (tmp_path / ".stage").mkdir()
    (tmp_path / ".stage" / "bundle.tar.part00").write_bytes(b"z" * 5000)
    assert stage.repository_bytes(tmp_path) == 1000 + 300 + len(".stage/\n")


def test_repository_bytes_outside_a_checkout_says_what_to_do(tmp_path):
    with pytest.raises(stage.StageError, match="stage from a git checkout"):
        stage.repository_bytes(tmp_path / "nowhere")


def test_a_malformed_selection_line_is_a_usage_error_naming_its_line():
    # the inventory phase's --staged check reads the same file as the install phase
    with pytest.raises(stage.StageError, match=r"sel\.txt:2: expected .*found 'torch 2\.14\.0'.*Re-stage") as caught:
        stage.parse_selection("nvidia-z==2.0  -  copied\ntorch 2.14.0\n", "sel.txt")
    assert caught.value.exit_code == status.USAGE
