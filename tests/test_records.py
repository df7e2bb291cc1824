"""The records' raw data (dsa_image/records/store.py): packed into each record's raw.tar.xz, cited in
its README by sha256, read back only when it is what the README cites. No GPU, no network."""

from __future__ import annotations

import io
import json
import lzma
import tarfile
from pathlib import Path

import pytest

from dsa_image.records import store as records

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


def _record(tmp_path: Path, readme: str = "# A run\n\nLogs: [server.log](server.log), [sub/](sub/).\n") -> Path:
    record = tmp_path / "run"
    (record / "sub").mkdir(parents=True)
    (record / "README.md").write_text(readme)
    (record / "server.log").write_text("INFO started\n")
    (record / "sub" / "report.json").write_text('{"ok": true}\n')
    (record / "plot.png").write_bytes(b"\x89PNG")
    return record


def test_pack_archives_the_raw_files_and_cites_each_in_the_readme(tmp_path):
    record = _record(tmp_path)
    claim = records.pack(record)
    assert sorted(p.relative_to(record).as_posix() for p in record.rglob("*") if p.is_file()) == [
        "README.md", "plot.png", "raw.tar.xz"]
    assert records.read_archive(record) == {"server.log": b"INFO started\n", "sub/report.json": b'{"ok": true}\n'}
    raw = (record / "raw.tar.xz").read_bytes()
    assert (claim.size, claim.sha256) == (len(raw), records.sha256(raw))
    assert [m.name for m in claim.members] == ["server.log", "sub/report.json"]
    readme = (record / "README.md").read_text()
    assert "Logs: `server.log`, `sub/`." in readme and f"sha256 `{records.sha256(raw)}`" in readme
    assert records.problems(record) == []


def test_the_same_files_make_the_same_archive(tmp_path):
    files = {"b.log": b"2", "a/x.json": b"{}"}
    assert records.archive_bytes(files) == records.archive_bytes(dict(reversed(files.items())))
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(records.archive_bytes(files)))) as tar:
        assert [(m.name, m.mtime, m.uid, m.uname, m.mode) for m in tar] == [
            ("a/x.json", 0, 0, "", 0o644), ("b.log", 0, 0, "", 0o644)]


def test_links_become_names_and_headings_keep_their_anchors():
    text = ("## 1. Probe ([probe.json](probe.json), [.txt](probe.txt))\n"
            "See [A](server-A.log), [probe.json](probe.json#x), [other](../other/README.md),\n"
            "[web](https://example.com/probe.json) and ![plot](plot.png).\n")
    assert records.relink(text, {"probe.json", "probe.txt", "server-A.log"}) == (
        "## 1. Probe (`probe.json`, `.txt`)\n"
        "See A (`server-A.log`), `probe.json`, [other](../other/README.md),\n"
        "[web](https://example.com/probe.json) and ![plot](plot.png).\n")


def test_packing_again_adds_new_files_and_keeps_the_text_after_the_section(tmp_path):
    record = _record(tmp_path)
    records.pack(record)
    readme = record / "README.md"
    readme.write_text(readme.read_text() + "\nA note written later.\n")
    (record / "late.txt").write_text("late\n")
    claim = records.pack(record)
    assert [m.name for m in claim.members] == ["late.txt", "server.log", "sub/report.json"]
    text = readme.read_text()
    assert text.count(records.BEGIN) == 1 and text.endswith("A note written later.\n")
    assert records.problems(record) == []


def test_a_pack_cut_short_after_the_archive_finishes_when_run_again(tmp_path):
    record = _record(tmp_path)
    records.pack(record)
    (record / "server.log").write_text("INFO started\n")  # as if the crash came before the unlink
    records.pack(record)
    assert records.problems(record) == [] and not (record / "server.log").exists()


def test_a_loose_file_that_differs_from_its_packed_namesake_is_refused(tmp_path):
    record = _record(tmp_path)
    records.pack(record)
    before = (record / "raw.tar.xz").read_bytes()
    (record / "server.log").write_text("something else\n")
    with pytest.raises(records.RecordError, match="server.log differ from the same names in raw.tar.xz"):
        records.pack(record)
    assert (record / "raw.tar.xz").read_bytes() == before


def test_problems_name_what_differs_from_the_readme(tmp_path):
    record = _record(tmp_path)
    records.pack(record)
    (record / "new.log").write_text("x")
    assert records.problems(record) == [f"{record / 'new.log'}: not packed; run `python3 scripts/records.py pack {record}`"]
    (record / "new.log").unlink()
    readme = record / "README.md"
    good = readme.read_text()
    readme.write_text(good.replace("| `server.log` | 13 |", "| `server.log` | 14 |"))
    (problem,) = records.problems(record)
    assert problem.startswith(f"{readme}: lists server.log, which raw.tar.xz holds with 13 bytes")
    readme.write_text(good)
    (record / "raw.tar.xz").write_bytes(records.archive_bytes({"server.log": b"INFO started\n"}))
    (problem,) = records.problems(record)
    assert "raw.tar.xz: " in problem and "README.md cites" in problem
    with pytest.raises(records.RecordError, match="README.md cites"):
        records.extract(record, tmp_path / "out")


def test_the_section_says_which_receipts_the_run_ran_and_a_hand_edit_is_found(tmp_path):
    record = _record(tmp_path)
    receipt = json.dumps({"schema": 1, "files": [], "manifest_sha256": "ab" * 32, "vllm_version": "0.33.0"}).encode()
    (record / "receipt.json").write_bytes(receipt)
    (record / "results.json").write_text(json.dumps({"environment": {"builds": {
        "A": {"versions": {"vllm": "0.33.0"}}, "B": {"versions": {"vllm": "0.33.0", "overlay_receipt_sha256": "cd" * 32}}}}}))
    records.pack(record)
    readme = record / "README.md"
    text = readme.read_text()
    assert f"- `receipt.json`: vLLM 0.33.0, receipt sha256 `{records.sha256(receipt)}`, overlay manifest sha256 `{'ab' * 32}`\n" in text
    assert f"- `results.json` build B: vLLM 0.33.0, receipt sha256 `{'cd' * 32}`\n" in text
    assert "build A" not in text  # stock: no overlay, no receipt
    readme.write_text(text.replace(f"receipt sha256 `{'cd' * 32}`", f"receipt sha256 `{'ef' * 32}`"))
    (problem,) = records.problems(record)
    assert "its raw-data section is not what `pack` writes for raw.tar.xz" in problem


def test_extract_writes_every_member_and_never_over_a_file(tmp_path):
    record = _record(tmp_path)
    records.pack(record)
    assert records.extract(record, tmp_path / "out") == ["server.log", "sub/report.json"]
    assert (tmp_path / "out" / "sub" / "report.json").read_text() == '{"ok": true}\n'
    with pytest.raises(FileExistsError):
        records.extract(record, tmp_path / "out")


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../b", "a//b", "a\\b"])
def test_an_archive_member_outside_the_record_is_refused(tmp_path, name):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    (tmp_path / "raw.tar.xz").write_bytes(lzma.compress(buffer.getvalue()))
    with pytest.raises(records.RecordError, match="not a relative, normalised path"):
        records.read_archive(tmp_path)


def test_a_link_or_a_second_copy_in_an_archive_is_refused(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        link = tarfile.TarInfo("log")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    (tmp_path / "raw.tar.xz").write_bytes(lzma.compress(buffer.getvalue()))
    with pytest.raises(records.RecordError, match="'log' is not a regular file"):
        records.read_archive(tmp_path)
    (tmp_path / "raw.tar.xz").write_bytes(b"not xz")
    with pytest.raises(records.RecordError, match="not a readable tar.xz"):
        records.read_archive(tmp_path)


def test_the_command_line_checks_and_exits_1_on_a_problem(tmp_path, capsys):
    record = _record(tmp_path)
    assert records.main(["check", str(record)]) == 1
    assert "not packed" in capsys.readouterr().out
    assert records.main(["pack", str(record)]) == 0
    assert records.main(["check", str(record)]) == 0
    assert records.main(["pack", str(tmp_path / "none")]) == 2
    assert "no README.md" in capsys.readouterr().err


def test_an_excerpt_is_the_head_and_the_matching_lines_whole():
    text = "banner\nINFO a\nDEBUG b\nbar 10%\rINFO bar 20%\nINFO c"
    assert records.excerpt(text, r"INFO", head=1) == "banner\nINFO a\nbar 10%\rINFO bar 20%\nINFO c"


# -- the committed records ---------------------------------------------------------------------------

RECORDS = records.record_dirs(REPO)


def test_the_records_are_found():
    assert {r.parent.name for r in RECORDS} == {"validation", "benchmarks"} and len(RECORDS) >= 16


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.name)
def test_each_record_is_intact_and_its_json_parses(record):
    assert records.problems(record) == []
    for name, data in records.read_archive(record).items():
        if name.endswith(".json"):
            json.loads(data)


def test_the_test_excerpts_are_what_their_spec_makes_from_the_records():
    made = records.excerpts(DATA / "excerpts.toml", REPO)
    assert made and {path: path.read_bytes().decode() for path in made} == made
