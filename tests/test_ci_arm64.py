"""CI builds the sm120 arm64 image (DGX Spark) under QEMU and checks it.

* `.ci/run`, run for real in a copy whose helper scripts are stubs that log their calls: it
  registers QEMU before anything arm64, makes the arm64 base, runs the arm64 step with it beside
  the tests (its output after theirs) whatever their result, and fails when either fails.
* `scripts/build_arm64.py` against a fake `docker` CLI: it bakes sm120 for linux/arm64 with the
  given base, runs the arch checks, `uname -m` and `verify` in that image, and fails when one of
  them fails or the image is not arm64; it builds nothing when QEMU is not ready.
* `scripts/install_qemu.sh --check` on fake binfmt_misc directories fails closed, naming what
  is missing (the F flag above all); on a machine where QEMU is installed (CI: .ci/run installs
  it first) the check passes, an aarch64 program runs in a chroot, and the installer is a no-op.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
INSTALL_QEMU = REPO / "scripts" / "install_qemu.sh"
BINFMT = Path("/proc/sys/fs/binfmt_misc")
on_aarch64 = pytest.mark.skipif(platform.machine() == "aarch64", reason="arm64 runs natively here: no QEMU")

# -- .ci/run with stubbed helpers -----------------------------------------------------------

SHELL_STUB = '#!/usr/bin/env bash\necho "{name} $*" >> "$CI_CALLS"\nexit "${{CI_EXIT_{var}:-0}}"\n'
PYTHON_STUB = ('import os, sys\nwith open(os.environ["CI_CALLS"], "a") as f:\n'
               '    f.write(" ".join(["{name}", *sys.argv[1:]]) + "\\n")\n'
               'print("{name}: its output")\n'
               'sys.exit(int(os.environ.get("CI_EXIT_{var}", "0")))\n')
HELPERS = ["install_docker.sh", "install_qemu.sh", "bootstrap_base_image.sh", "test.py", "build_arm64.py",
           "lint.py", "release_check.py"]


def _var(name: str) -> str:
    return name.split(".")[0].upper()


def run_ci(tmp_path: Path, **exit_codes: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the real .ci/run in a copy where every script it calls is a stub logging its call;
    CI_EXIT_<NAME>=code makes that stub fail."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    for name in HELPERS:
        stub = SHELL_STUB if name.endswith(".sh") else PYTHON_STUB
        (tmp_path / "scripts" / name).write_text(stub.format(name=name, var=_var(name)))
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "CI_CALLS": str(calls), **{f"CI_EXIT_{k.upper()}": str(v) for k, v in exit_codes.items()}}
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run"), "-k", "something"], env=env,
                          capture_output=True, text=True, timeout=60)
    return done, [line.rstrip() for line in calls.read_text().splitlines()] if calls.exists() else []


def _index(calls: list[str], prefix: str) -> int:
    found = [i for i, call in enumerate(calls) if call.startswith(prefix)]
    assert found, f"{prefix!r} was not called: {calls}"
    return found[0]


def test_ci_registers_qemu_then_builds_and_checks_the_arm64_image(tmp_path):
    done, calls = run_ci(tmp_path)
    assert done.returncode == 0, done.stderr
    qemu = _index(calls, "install_qemu.sh")
    assert calls[qemu] == "install_qemu.sh", "CI installs QEMU (not only --check)"
    assert _index(calls, "install_docker.sh") < qemu
    arm64_base = _index(calls, "bootstrap_base_image.sh dsa-image-base:bookworm-arm64 arm64")
    arm64_step = _index(calls, "build_arm64.py")
    assert qemu < arm64_base < arm64_step, "QEMU must be registered before anything arm64 runs"
    assert calls[arm64_step] == "build_arm64.py --base-image dsa-image-base:bookworm-arm64"
    # --durations: a CI log names the slowest tests, so a run near its time limit shows where it went
    assert calls[_index(calls, "test.py")] == "test.py -ra --durations=25 -k something"


def test_ci_builds_arm64_beside_the_tests_and_prints_its_output_after_theirs(tmp_path):
    """Started before the tests (cold, the two in a row outran CI's 90 minutes), the arm64 step's
    output goes to a file and is printed once the tests end, not interleaved with theirs."""
    done, calls = run_ci(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "build_arm64.py: its output" not in done.stdout
    after_tests = done.stderr.split("ci: tests finished", 1)[1]
    assert "build_arm64.py: its output" in after_tests.split("ci: arm64 image step finished", 1)[0]
    assert (tmp_path / "build" / "logs" / "ci-arm64-step.txt").read_text() == "build_arm64.py: its output\n"


def test_ci_fails_when_the_arm64_step_fails_though_the_tests_passed(tmp_path):
    done, calls = run_ci(tmp_path, build_arm64=1)
    assert done.returncode != 0
    assert "arm64 image: exit 1" in done.stderr
    assert any(call.startswith("test.py") for call in calls)


def test_ci_runs_the_arm64_step_after_failed_tests_and_keeps_their_exit_code(tmp_path):
    done, calls = run_ci(tmp_path, test=3)
    assert done.returncode == 3, done.stderr
    assert any(call.startswith("build_arm64.py") for call in calls)


def test_ci_runs_the_release_check_last_and_only_as_the_commit_asks(tmp_path):
    done, calls = run_ci(tmp_path)
    assert done.returncode == 0, done.stderr
    assert calls[-1] == "release_check.py --if-records-changed"  # it decides from git whether it is due
    assert _index(calls, "build_arm64.py") < len(calls) - 1


def test_ci_fails_when_the_release_check_fails_and_still_builds_arm64(tmp_path):
    done, calls = run_ci(tmp_path, release_check=1)
    assert done.returncode == 1 and "release check: exit 1" in done.stderr
    assert any(call.startswith("build_arm64.py") for call in calls)
    (tmp_path / "again").mkdir()
    done, calls = run_ci(tmp_path / "again", test=3, release_check=1)
    assert done.returncode == 3 and any(call.startswith("release_check.py") for call in calls)


def test_ci_runs_the_lint_and_type_gates_and_fails_on_them_after_everything_else_ran(tmp_path):
    done, calls = run_ci(tmp_path, lint=1)
    assert done.returncode == 1 and "lint: exit 1" in done.stderr, done.stderr
    assert _index(calls, "build_arm64.py") < _index(calls, "lint.py") < _index(calls, "release_check.py")
    (tmp_path / "again").mkdir()
    done, _ = run_ci(tmp_path / "again", test=3, lint=1)
    assert done.returncode == 3  # the tests' code comes first


def test_ci_stops_before_any_build_when_qemu_cannot_be_installed(tmp_path):
    done, calls = run_ci(tmp_path, install_qemu=1)
    assert done.returncode != 0
    assert not any(call.startswith(("bootstrap_base_image.sh", "test.py", "build_arm64.py")) for call in calls), calls


def _ci_texts() -> dict[str, str]:
    """What says what CI builds: .ci/run, the arm64 step's docstring, docs/image.md's CI parts."""
    image_md = (REPO / "docs" / "image.md").read_text()
    return {".ci/run": (REPO / ".ci" / "run").read_text(),
            "dsa_image/build/arm64_build.py": (REPO / "dsa_image" / "build" / "arm64_build.py").read_text().split('"""')[1],
            "docs/image.md, In CI": image_md.split("### In CI\n", 1)[1].split("\n## ", 1)[0],
            "docs/image.md, CI": image_md.split("## CI: `.ci/run`\n", 1)[1].split("\n## ", 1)[0]}


def test_ci_and_its_docs_name_the_targets_ci_builds():
    """CI builds the default base under the plain names (`test`, `sm120`) and every other base's
    `test` target under its own name: a base-suffixed name in what describes CI is another
    base's, and the other bases' test targets are the ones named."""
    from dsa_image.core.recipe import load_every_base
    others = [base for base in load_every_base() if base.vllm_version != base.default_vllm]
    suffixes = {f"vllm{base.vllm_version.replace('.', '_')}" for base in others}
    for where, text in _ci_texts().items():
        named = set(re.findall(r"\b[a-z0-9]+-(vllm\d+_\d+_\d+)\b", text))
        assert named <= suffixes, f"{where} names the default base by its suffix: {sorted(named - suffixes)}"
    for where in (".ci/run", "docs/image.md, CI"):
        assert {base.bake_target("test") for base in others} <= set(
            re.findall(r"\btest-vllm\d+_\d+_\d+\b", _ci_texts()[where])), where


# -- scripts/build_arm64.py against a fake docker CLI -----------------------------------------

FAKE_DOCKER = r'''#!/usr/bin/env python3
"""A docker CLI that logs each call and answers like the real one for what build_arm64 asks."""
import json, os, sys, time
args = sys.argv[1:]
# what a CPU directory mounted at /sys/devices/system/cpu says about cpu0, while the run lasts
cpu = [a.split(":")[0] for a in args if a.endswith(":/sys/devices/system/cpu:ro")]
midr = os.path.join(cpu[0], "cpu0/regs/identification/midr_el1") if cpu else ""
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps({"args": args, "BASE_IMAGE": os.environ.get("BASE_IMAGE"),
                        "TAG": os.environ.get("TAG"), "BUILD_NETWORK": os.environ.get("BUILD_NETWORK"),
                        "midr": open(midr).read().strip() if os.path.isfile(midr) else None}) + "\n")
image = f"dsa-image:{os.environ.get('TAG')}-sm120"
if args[:3] == ["buildx", "bake", "--print"]:
    target = next(a for a in args[3:] if not a.startswith("-"))
    print(json.dumps({"target": {target: {"tags": [image], "output": ["type=docker"]}}}))
elif args[:2] == ["buildx", "bake"]:
    print("#7 [linux/arm64 deps 1/2] RUN pip install --require-hashes", flush=True)
    time.sleep(float(os.environ.get("FAKE_BAKE_SECONDS", "0")))  # the pip step running
    print("#7 DONE 612.5s\n"
          "#8 [linux/arm64 overlay 1/7] COPY dsa_image/ /opt/dsa-image/tool/dsa_image/\n#8 CACHED")
    if os.environ.get("FAKE_BAKE_ENOSPC"):
        print("#7 877.3 ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device")
    sys.exit(int(os.environ.get("FAKE_BAKE_EXIT", "0")))
elif args[0] == "info":
    print(os.environ["FAKE_CALLS"].rsplit("/", 1)[0])
elif args[:2] == ["image", "inspect"]:
    labels = {"dsa-image.cuda-arch": os.environ["FAKE_CUDA_ARCH"],
              "dsa-image.receipt.sha256": os.environ["FAKE_RECEIPT"]}
    print(os.environ.get("FAKE_PLATFORM", "linux/arm64") + " " + json.dumps(labels))
elif args[0] == "run":
    if "uname" in args:
        print("aarch64")
    elif args[-1] == "verify":
        print(f"dsa-image: receipt /opt/dsa-image/receipt.json sha256 {os.environ['FAKE_RECEIPT']} matches the build")
        sys.exit(int(os.environ.get("FAKE_VERIFY_EXIT", "0")))
    else:
        print("ok  arch checks")
        sys.exit(int(os.environ.get("FAKE_ARCHCHECK_EXIT", "0")))
else:
    sys.exit(f"fake docker: unexpected {args}")
'''


def _load_build_arm64():
    from dsa_image.build import arm64_build
    return arm64_build


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    """build_arm64 with a fake docker first on PATH; returns (module, read_calls)."""
    from dsa_image.core.recipe import load_recipe
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "docker").write_text(FAKE_DOCKER)
    (bindir / "docker").chmod(0o755)
    calls = tmp_path / "docker-calls.jsonl"
    bake_json = json.loads((REPO / "docker-bake.json").read_text())
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    monkeypatch.setenv("FAKE_CUDA_ARCH", ";".join(load_recipe().target("sm120").cuda_arch))
    monkeypatch.setenv("FAKE_RECEIPT", bake_json["variable"]["VLLM"]["default"][load_recipe().vllm_version]["RECEIPT_SHA256"])
    for name in ("BASE_IMAGE", "TAG", "PUSH", "REGISTRY", "IMAGE"):
        monkeypatch.delenv(name, raising=False)
    module = _load_build_arm64()
    monkeypatch.setattr(module, "qemu_ready", lambda repo: None)

    def read_calls() -> list[dict]:
        return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

    return module, read_calls


def _arm64_run(call: dict) -> bool:
    args = call["args"]
    return args[0] == "run" and args[args.index("--platform") + 1] == "linux/arm64"


def test_the_arm64_step_bakes_sm120_for_arm64_and_checks_it_in_that_image(fake_docker, tmp_path, capsys):
    module, read_calls = fake_docker
    from dsa_image.core.recipe import load_recipe
    code = module.main(["--base-image", "dsa-image-base:bookworm-arm64", "--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 0, err
    calls = read_calls()
    bake = [c for c in calls if c["args"][:2] == ["buildx", "bake"] and "--print" not in c["args"]]
    assert len(bake) == 1
    args = bake[0]["args"]
    assert args[2] == "sm120" and args[args.index("--set") + 1] == "sm120.platform=linux/arm64"
    assert bake[0]["BASE_IMAGE"] == "dsa-image-base:bookworm-arm64"
    assert bake[0]["TAG"] == f"{load_recipe().vllm_version}-arm64"
    image = f"dsa-image:{load_recipe().vllm_version}-arm64-sm120"
    runs = [c["args"] for c in calls if c["args"][0] == "run"]
    assert runs and all(_arm64_run(c) for c in calls if c["args"][0] == "run"), runs
    assert any(r[-2:] == [image, "verify"] for r in runs), runs
    arch = [r for r in runs if any("arch_check.py toolchain" in a for a in r)]
    assert arch and any("arch_check.py extensions" in a for a in arch[0]), runs
    assert ";".join(load_recipe().target("sm120").cuda_arch) in arch[0]
    # what was rebuilt is said, and the digest of the inputs
    assert "1 of 2 Dockerfile steps ran now" in err and "[linux/arm64 deps 1/2]" in err
    assert "build inputs sha256 " in err and "locks " in err and "overlay " in err
    assert (tmp_path / "logs" / "bake-sm120-arm64.log").is_file()


def test_the_arm64_step_says_every_heartbeat_how_long_the_bake_has_run_and_which_step_runs(
        fake_docker, tmp_path, monkeypatch, capsys):
    """A cold arm64 bake runs ~20 minutes, most of it in one pip step: CI's log gets a line
    a heartbeat (a minute in CI) while it runs, not silence."""
    module, _ = fake_docker
    monkeypatch.setattr(module, "HEARTBEAT_S", 0.2)
    monkeypatch.setenv("FAKE_BAKE_SECONDS", "2.5")
    assert module.main(["--log-dir", str(tmp_path / "logs")]) == 0
    err = capsys.readouterr().err
    beats = [line for line in err.splitlines() if line.startswith("build_arm64: baking sm120 for linux/arm64: ")]
    running = [line for line in beats if "running for " in line]
    assert len(running) >= 3 and all("[linux/arm64 deps 1/2] RUN pip install" in line for line in running), err
    # the time so far and the step's own time, both growing
    assert re.search(r": 0 min [1-9] s, 0 steps done; running for 0 min [1-9] s: ", "\n".join(running)), running
    assert err.index(beats[-1]) < err.index("built dsa-image:"), "the heartbeats came after the bake"


@on_aarch64
def test_emulated_every_check_sees_a_cpu_directory_with_midr_el1(fake_docker, tmp_path, capsys):
    """torch 2.14 aborts its import under QEMU without /sys/.../midr_el1 (the 0.33.0 arm64 image's
    verify did): every run in the image gets one, and it is gone after the step."""
    module, read_calls = fake_docker
    assert module.main(["--log-dir", str(tmp_path / "logs")]) == 0, capsys.readouterr().err
    runs = [c for c in read_calls() if c["args"][0] == "run"]
    assert len(runs) == 3 and {c["midr"] for c in runs} == {module.EMULATED_MIDR}  # uname, arch checks, verify
    mounted = {a.split(":")[0] for c in runs for a in c["args"] if a.endswith(f":{module.CPU_SYSFS}:ro")}
    assert mounted and not any(Path(m).exists() for m in mounted)


def test_the_emulated_cpu_directory_lists_every_cpu(tmp_path):
    from dsa_image.build import arm64_build
    cpu = arm64_build.write_cpu_sysfs(tmp_path / "cpu", 3)
    assert (cpu / "online").read_text() == "0-2\n" == (cpu / "possible").read_text()
    assert sorted(p.name for p in cpu.glob("cpu*")) == ["cpu0", "cpu1", "cpu2"]
    assert (cpu / "cpu2/regs/identification/midr_el1").read_text() == "0x00000000410fd850\n"
    assert (arm64_build.write_cpu_sysfs(tmp_path / "one", 1) / "online").read_text() == "0\n"


def test_another_base_bakes_its_own_target_and_is_checked_against_its_own_receipt(fake_docker, tmp_path, monkeypatch,
                                                                                  capsys):
    module, read_calls = fake_docker
    from dsa_image.core.recipe import load_every_base
    other = next(b for b in load_every_base() if b.vllm_version != b.default_vllm)
    bake_json = json.loads((REPO / "docker-bake.json").read_text())
    monkeypatch.setenv("FAKE_RECEIPT", bake_json["variable"]["VLLM"]["default"][other.vllm_version]["RECEIPT_SHA256"])
    code = module.main(["--vllm", other.vllm_version, "--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 0, err
    bake = [c for c in read_calls() if c["args"][:2] == ["buildx", "bake"] and "--print" not in c["args"]]
    target = other.bake_target("sm120")
    assert bake[0]["args"][2] == target and f"{target}.platform=linux/arm64" in bake[0]["args"]
    assert bake[0]["TAG"] == f"{other.vllm_version}-arm64"
    assert (tmp_path / "logs" / f"bake-{target}-arm64.log").is_file()


def test_an_unknown_base_is_a_usage_error(fake_docker, tmp_path, capsys):
    module, read_calls = fake_docker
    assert module.main(["--vllm", "0.99.0", "--log-dir", str(tmp_path / "logs")]) == 2
    assert "0.99.0" in capsys.readouterr().err and read_calls() == []


@pytest.mark.parametrize("failure, message", [
    ({"FAKE_VERIFY_EXIT": "1"}, "verify in dsa-image"),
    ({"FAKE_ARCHCHECK_EXIT": "1"}, "the arch checks"),
    ({"FAKE_BAKE_EXIT": "1"}, "build of sm120 failed"),
    ({"FAKE_BAKE_EXIT": "1", "FAKE_BAKE_ENOSPC": "1"}, "GB available to build steps; a cold arm64 build needs"),
    ({"FAKE_PLATFORM": "linux/amd64"}, "is linux/amd64, not linux/arm64"),
    ({"FAKE_RECEIPT": "0" * 64}, "labels say"),
])
def test_the_arm64_step_fails_when_the_build_or_a_check_fails(fake_docker, tmp_path, monkeypatch, capsys,
                                                              failure, message):
    module, _ = fake_docker
    for name, value in failure.items():
        monkeypatch.setenv(name, value)
    code = module.main(["--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 1 and "FAILED" in err and message in err, err


@on_aarch64
def test_the_arm64_step_builds_nothing_when_qemu_is_not_ready(tmp_path, monkeypatch, capsys):
    """The real qemu check, on a binfmt_misc without a qemu-aarch64 entry."""
    (tmp_path / "binfmt").mkdir()
    (tmp_path / "binfmt" / "register").touch()
    monkeypatch.setenv("BINFMT_MISC", str(tmp_path / "binfmt"))
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "docker").write_text("#!/bin/sh\necho called >> \"$0.calls\"; exit 1\n")
    (tmp_path / "docker").chmod(0o755)
    module = _load_build_arm64()
    assert module.main(["--log-dir", str(tmp_path / "logs")]) == 1
    err = capsys.readouterr().err
    assert "no qemu-aarch64 entry" in err and "QEMU user emulation for arm64 is not ready" in err
    assert not (tmp_path / "docker.calls").exists(), "docker was called though QEMU is not ready"


def test_the_input_digest_follows_the_locks_and_the_overlay(tmp_path):
    module = _load_build_arm64()
    for name in ("recipes/locks/vllm-0.24.0/vllm-arm64.txt", "overlay/vllm-0.24.0/manifest.json", "Dockerfile"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    first = module.inputs_digest(tmp_path, module.INPUTS)
    (tmp_path / "recipes/locks/vllm-0.24.0/vllm-arm64.txt").write_text("y\n")
    second = module.inputs_digest(tmp_path, module.INPUTS)
    (tmp_path / "overlay" / "__pycache__").mkdir()
    (tmp_path / "overlay" / "__pycache__" / "m.pyc").write_text("z")
    assert first != second == module.inputs_digest(tmp_path, module.INPUTS)
    assert {"Dockerfile", "recipes", "overlay", "dsa_image", "scripts"} <= set(module.INPUTS)


# -- scripts/install_qemu.sh ------------------------------------------------------------------

def check_qemu(binfmt: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"BINFMT_MISC": str(binfmt)} if binfmt else {})}
    return subprocess.run(["bash", str(INSTALL_QEMU), "--check"], env=env, capture_output=True, text=True,
                          timeout=120)


def fake_binfmt(tmp_path: Path, entry: str | None, mounted: bool = True) -> Path:
    directory = tmp_path / "binfmt_misc"
    directory.mkdir()
    if mounted:
        (directory / "register").touch()
    if entry is not None:
        (directory / "qemu-aarch64").write_text(entry)
    return directory


ENTRY = "{state}\ninterpreter {interpreter}\nflags: {flags}\noffset 0\nmagic 7f454c46\n"


@on_aarch64
@pytest.mark.parametrize("entry, mounted, message", [
    (None, False, "binfmt_misc is not mounted"),
    (None, True, "no qemu-aarch64 entry"),
    (ENTRY.format(state="disabled", interpreter="/bin/sh", flags="PF"), True, "update-binfmts --enable qemu-aarch64"),
    (ENTRY.format(state="enabled", interpreter="/bin/sh", flags="P"), True, "without F (fix-binary)"),
    (ENTRY.format(state="enabled", interpreter="/nonexistent/qemu", flags="PF"), True, "does not exist"),
])
def test_the_qemu_check_fails_closed_naming_what_is_missing(tmp_path, entry, mounted, message):
    done = check_qemu(fake_binfmt(tmp_path, entry, mounted))
    assert done.returncode == 1, done.stderr
    assert "NOT READY" in done.stderr and message in done.stderr, done.stderr


def qemu_here() -> str | None:
    """Why the real check cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (a chroot)"
    if not (BINFMT / "qemu-aarch64").exists():
        return f"QEMU is not registered in {BINFMT}: bash scripts/install_qemu.sh"
    return None


@on_aarch64
def test_qemu_is_ready_here_and_installing_again_changes_nothing():
    """CI installs QEMU before the tests, so there (DSA_IMAGE_REQUIRE_DOCKER=1) this must run."""
    reason = qemu_here()
    if reason:
        if os.environ.get("DSA_IMAGE_REQUIRE_DOCKER") == "1":
            pytest.fail(f"{reason} (CI: .ci/run installs QEMU before the tests)")
        pytest.skip(reason)
    done = check_qemu()
    assert done.returncode == 0, done.stderr
    assert "ready: qemu-aarch64 enabled, flags " in done.stderr and "F: fix-binary" in done.stderr
    assert "an aarch64 program ran in an empty chroot (exit 42)" in done.stderr
    again = subprocess.run(["bash", str(INSTALL_QEMU)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "already installed" in again.stderr and "qemu-aarch64 already registered" in again.stderr
    assert "installing" not in again.stderr and "registering" not in again.stderr


def test_the_qemu_installer_rejects_unknown_arguments():
    done = subprocess.run(["bash", str(INSTALL_QEMU), "--force"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr


def test_docs_say_how_ci_builds_arm64():
    image_md = (REPO / "docs" / "image.md").read_text()
    section = image_md.split("## The arm64 image on an x86-64 host (DGX Spark)", 1)[1].split("\n## ", 1)[0]
    for needed in ("scripts/install_qemu.sh", "scripts/build_arm64.py", "--set sm120.platform=linux/arm64",
                   "dsa-image-base:bookworm-arm64", "verify", "fix-binary", "build/logs/bake-sm120-arm64.log"):
        assert needed in section, needed
