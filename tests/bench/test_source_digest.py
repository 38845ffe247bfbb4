"""scripts/source_digest.py, which names the code a measurement ran: a working tree and the commit it
matches give the same digest, any change to a source file under mpigpu/ changes it and nothing else
does, and ``find`` gives back the commits that hold a digest."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import ROOT, load_script

digests = load_script(ROOT / "scripts" / "source_digest.py", "source_digest_under_test")


def _git(repo: Path, *args: str) -> str:
    env_args = ["-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false"]
    return subprocess.run(["git", "-C", str(repo), *env_args, *args], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "mpigpu" / "job").mkdir(parents=True)
    (repo / "mpigpu" / "__init__.py").write_text("x = 1\n")
    (repo / "mpigpu" / "job" / "board.c").write_text("int f(void) { return 1; }\n")
    (repo / "mpigpu" / "notes.txt").write_text("not source\n")
    (repo / "README.md").write_text("readme\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "first")
    return repo


def test_a_clean_tree_and_its_commit_give_one_digest_and_only_source_changes_move_it(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    first = digests.tree_digest(repo)
    assert len(first) == digests.LENGTH and first == digests.commit_digest("HEAD", repo)
    (repo / "README.md").write_text("changed\n")
    (repo / "mpigpu" / "notes.txt").write_text("changed\n")
    assert digests.tree_digest(repo) == first, "only source files count"
    (repo / "mpigpu" / "job" / "board.c").write_text("int f(void) { return 2; }\n")
    second = digests.tree_digest(repo)
    assert second != first
    _git(repo, "commit", "-qam", "second")
    (repo / "mpigpu" / "job" / "new.py").write_text("")  # a new, empty file is a change too
    assert digests.tree_digest(repo) != second
    assert digests.commit_digest("HEAD", repo) == second and digests.commit_digest("HEAD~1", repo) == first
    head, parent = _git(repo, "rev-parse", "--short", "HEAD"), _git(repo, "rev-parse", "--short", "HEAD~1")
    assert digests.find(second, repo) == [head] and digests.find(first[:8], repo) == [parent]
    assert digests.find("0" * 12, repo) == []


def test_this_checkouts_digest_is_printed_in_its_short_form(capsys) -> None:
    assert digests.main([]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == digests.tree_digest() and len(printed) == digests.LENGTH and int(printed, 16) >= 0
