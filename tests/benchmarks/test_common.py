"""The tail the benchmarks share: what a report writes and prints, and the exit codes."""

from __future__ import annotations

import json

from benchmarks.common import exit_code, report, say_as


def test_report_writes_json_and_markdown_where_asked_and_prints_the_table(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = {"samples_per_s": 1.5, "path": tmp_path}  # a Path is written as its string
    text = report(result, str(tmp_path / "out" / "r.json"), table="| a |\n", markdown=True,
                  run_dir=run_dir, name="grpo", say=say_as("grpo"))
    for path in (tmp_path / "out" / "r.json", run_dir / "bench-grpo.json"):
        assert json.loads(path.read_text()) == {"samples_per_s": 1.5, "path": str(tmp_path)}
        assert path.with_suffix(".md").read_text() == "| a |\n"
    assert json.loads(text)["samples_per_s"] == 1.5
    wrote = f"[bench grpo] wrote {tmp_path / 'out' / 'r.json'} and {tmp_path / 'out' / 'r.md'}"
    assert capsys.readouterr().out == wrote + "\n| a |\n\n"  # the table is printed last


def test_a_plain_table_is_printed_not_written_and_without_a_table_the_json_is(tmp_path, capsys):
    report({"x": 1}, str(tmp_path / "r.json"), table="x  1")
    assert not (tmp_path / "r.md").exists()
    assert capsys.readouterr().out.splitlines()[-1] == "x  1"
    report({"x": 1}, None)
    assert json.loads(capsys.readouterr().out) == {"x": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_exit_codes():
    assert exit_code(True, "boom") == 130  # interrupted wins: the user asked it to stop
    assert exit_code(False, "boom") == 1
    assert exit_code(False, "") == 0 and exit_code(False) == 0
