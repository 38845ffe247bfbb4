"""The README's first steps work as written in a new shell (issue 39): exactly two set-up commands,
then the environment they made is activated before any command that needs it; it names only files a
clone has, and the console scripts pip installs."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def _commands(text: str) -> list[str]:
    """The indented command lines of ``text`` (the README's shell blocks), comments dropped."""
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.startswith("    ") and line.strip()]


def test_two_set_up_commands_then_the_environment_they_made() -> None:
    commands = _commands(_section("Two commands"))
    assert commands[:2] == ["scripts/run-average.sh", "scripts/test.sh"], commands
    setup = [c for c in commands if c.startswith("scripts/")]
    assert setup == ["scripts/run-average.sh", "scripts/test.sh"], "exactly two set-up commands"
    # in a new shell nothing the scripts installed is on the PATH: activate first
    assert commands[2] == ". .venv/bin/activate", commands
    assert any(c.startswith("mpiexec ") for c in commands[3:]) and "python -m mpigpu" in commands


def test_the_test_commands_run_in_the_test_environment() -> None:
    commands = _commands(_section("Tests"))
    first_bare = min(i for i, c in enumerate(commands) if c.startswith(("python", "mpiexec")))
    assert ". .venv-test/bin/activate" in commands[:first_bare], commands


def test_the_readme_names_files_a_clone_has() -> None:
    for path in re.findall(r"(?<![\w./-])((?:scripts|docs|samples|tests|bench)/[\w./-]*\w)", README):
        assert (ROOT / path).exists() or any(ROOT.glob(path)), (
            f"the README names {path}, which is not in the repository"
        )
    assert ".gpu-carry" not in README, "made by the project's GPU tooling, not in a clone: docs/usage.md explains it"


def test_the_console_scripts_are_named() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name in scripts:
        assert f"`{name}`" in README, name
