"""The version is kept in one place (mpigpu/_version.py; pyproject reads it) and the commands print it.
scripts/package-check.sh (run by .ci/run) builds the wheel and sdist and runs the installed command."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

from mpigpu._version import __version__


def test_pyproject_takes_the_version_from_the_package() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mpigpu._version.__version__"}


# every command a user can run (python -m mpigpu.<name>), old names included: the README says each has --version
COMMANDS = [
    "mpigpu",
    "mpigpu.average",
    "mpigpu.info",
    "mpigpu.run",
    "mpigpu.bench",
    "mpigpu.bench.main",
    "mpigpu.bench.training",
    "mpigpu.bench.soak",
    "mpigpu.bench.synthetic",
    "mpigpu.timeline",
    "mpigpu.cleanup",
]
# the old command names (mpigpu._moved.MOVED), kept working
OLD_COMMANDS = ["mpigpu.benchmark", "mpigpu.bench_training", "mpigpu.soak"]


def test_every_command_is_listed() -> None:
    """A new command (a module with a ``__main__`` guard, or a package's __main__) joins COMMANDS; the
    old names are exactly the commands the moved-paths table keeps."""
    from mpigpu._moved import MOVED

    package = ROOT / "mpigpu"
    found = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__main__")
        for path in package.rglob("*.py")
        if path.name == "__main__.py" or 'if __name__ == "__main__":' in path.read_text()
    }
    assert found == set(COMMANDS)
    assert sorted(old for old, moved in MOVED.items() if moved.command) == sorted(OLD_COMMANDS)


@pytest.mark.parametrize("command", COMMANDS + OLD_COMMANDS)
def test_commands_print_the_version(command: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", command, "--version"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"mpigpu {__version__}"


def _mpigpu(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mpigpu", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("args", [[], ["--help"], ["-h"]])
def test_python_m_mpigpu_lists_every_command(args: list[str]) -> None:
    """``python -m mpigpu`` (issue 39: it had no __main__) lists each current command, as typed."""
    from mpigpu.__main__ import COMMANDS as WORDS

    done = _mpigpu(*args)
    assert done.returncode == 0, done.stderr
    for module, _ in WORDS.values():
        assert f" -m {module} " in done.stdout, done.stdout
        assert module in COMMANDS  # a listed command exists (and prints --version above)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():  # the console scripts pip installs, each with what it runs
        assert f"{name} (= {target.split(':')[0].removesuffix('.main')})" in done.stdout, done.stdout
    old_names = {"mpigpu", "mpigpu.bench.main", "mpigpu.benchmark", "mpigpu.bench_training", "mpigpu.soak"}
    assert {module for module, _ in WORDS.values()} == set(COMMANDS) - old_names


def test_python_m_mpigpu_refuses_an_unknown_word() -> None:
    done = _mpigpu("averag")
    assert done.returncode == 2 and not done.stdout
    assert "unknown command 'averag'" in done.stderr and "average, info, bench, run" in done.stderr


def test_python_m_mpigpu_runs_a_command_by_its_word() -> None:
    done = _mpigpu("average", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:") and "--size" in done.stdout
