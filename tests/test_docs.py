"""The user-facing docs (README.md, docs/*.md) stay true to the repository and readable.

- every repository path a doc names exists: its links and the path-like words in its text
  (`services/...py`, `configs/x.toml`, `docs/x.md`, ...), but not run outputs (`runs/<id>/...`,
  `~/.cache/...`) or placeholders (`services/<name>/`);
- no run id (`d32`, `b1-b14`, `c-runs`): a doc says what hotloop does and measures now, and
  the history of runs is in git;
- README.md and docs/results.md stay short enough to be read;
- every TOML example loads through the project's config loader.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# The repository's top-level rooms: a word that starts with one of these names a repository path.
ROOTS = ("apps/", "benchmarks/", "compose/", "configs/", "deploy/", "docs/", "hotloop/", "protos/",
         "scripts/", "services/", "tests/", ".ci/")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path-like word: not inside a longer word, path or URL (`github.com/x/hotloop/...`).
PATH_WORD = re.compile(r"(?<![\w./~-])((?:%s)[\w./<>{}*-]*)" % "|".join(re.escape(r) for r in ROOTS))

# A run label: one letter and one or two digits (`d32`, `b1`), or a letter's runs (`c-runs`).
# Allowed: percentiles (p50, p95, p99), versions (v1, v41), the KL estimators k1-k3. The
# lookbehind leaves the second half of a range to its first (`b1-b14` is flagged by `b1`) and
# keeps a character class (`a-z0-9`) from reading as `z0`; a host in a URL (`nats://n1:4222`) is
# not a run.
RUN_LABEL = re.compile(r"(?<![-\w/])(?!(?:p\d|v\d|k[123]\b))[a-z]\d{1,2}\b(?!:\d)")
RUN_SERIES = re.compile(r"\b[a-z]-runs\b")


def run_ids(text: str) -> list[str]:
    """The run labels in `text`."""
    return RUN_LABEL.findall(text) + RUN_SERIES.findall(text)


def _is_output_or_placeholder(path: str) -> bool:
    return any(c in path for c in "<>{}*") or path.startswith(("runs/", "~"))


def named_paths(doc: Path) -> list[tuple[str, Path]]:
    """(as written, resolved) for every repository path `doc` names."""
    text = doc.read_text()
    found: list[tuple[str, Path]] = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same document
        path = target.split("#", 1)[0]
        if not _is_output_or_placeholder(path):
            found.append((target, (doc.parent / path).resolve()))
    for word in PATH_WORD.findall(text):
        path = word.rstrip(".,;:")
        if not _is_output_or_placeholder(path):
            found.append((word, ROOT / path))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    missing = sorted({written for written, path in named_paths(doc) if not path.exists()})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_no_run_ids(doc: Path) -> None:
    found = [(n, line.strip()[:100]) for n, line in enumerate(doc.read_text().splitlines(), 1)
             if run_ids(line)]
    assert not found, f"{doc.relative_to(ROOT)} cites runs by id (lines: {found})"


@pytest.mark.parametrize(("name", "most"), [("README.md", 130), ("docs/results.md", 400)])
def test_length(name: str, most: int) -> None:
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= most, f"{name} has {lines} lines, at most {most}"


@pytest.mark.parametrize("text", [
    "d32", "in b1-b14", "the c-runs", "x1", "runs `y3`", "(d19-d22, d27)", "z2 and z3",
    "since d28,", "run x6:"])
def test_run_id_pattern_flags(text: str) -> None:
    assert run_ids(text), text


@pytest.mark.parametrize("text", [
    "p50", "nats://n1:4222", "p95 / p99", "v41", "its v1", "n=8", "x86_64", "H100", "r=16", "k3", "a-z0-9",
    "sha256", "bf16 and fp32", "lr 1e-3", "hotloop.v1", "e2e", "`/v1/adapter`", "b1a4c2e",
    "S3", "top-k"])
def test_run_id_pattern_passes(text: str) -> None:
    assert not run_ids(text), text


def test_path_words_are_found_and_outputs_skipped(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("See `services/rollout/core.py`, [the doc](other.md#a) and docs/results.md.\n"
                   "Not `runs/<id>/report.md`, `services/<name>/`, ~/.cache/hotloop/models, "
                   "https://github.com/o/hotloop/tree or [web](https://example.com).\n")
    assert [w for w, _ in named_paths(doc)] == [
        "other.md#a", "services/rollout/core.py", "docs/results.md."]
    assert named_paths(doc)[0][1] == (tmp_path / "other.md").resolve()


TOML_BLOCK = re.compile(r"```toml\n(.*?)```", re.S)
TOML_EXAMPLES = [(doc, n, block) for doc in DOCS for n, block in enumerate(TOML_BLOCK.findall(doc.read_text()))]


@pytest.mark.parametrize(("doc", "n", "block"), TOML_EXAMPLES,
                         ids=[f"{d.relative_to(ROOT).as_posix()}#{n}" for d, n, _ in TOML_EXAMPLES])
def test_toml_examples_load(doc: Path, n: int, block: str, tmp_path: Path) -> None:
    """A config a doc shows is one a user can paste: every section and key checked by the
    project's own loader, as a command would at start."""
    from launch.sections import load

    path = tmp_path / "example.toml"
    path.write_text(block)
    load(str(path))


def test_toml_example_check_can_fail(tmp_path: Path) -> None:
    from launch.sections import load
    from hotloop.config import ConfigError

    path = tmp_path / "example.toml"
    path.write_text("[online]\ntenant_slots = 4\n")  # a [rollout] key under [online]
    with pytest.raises(ConfigError):
        load(str(path))
