"""What the scripts write by default is ignored by git, and scripts/test.sh says what it installs
(about 1.7 GB) before it installs it."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from conftest import ROOT


def _default_outputs() -> list[str]:
    """Every ``OUT=${OUT:-$PWD/<folder>}`` default in scripts/*.sh."""
    found = []
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        found += re.findall(r"OUT=\$\{OUT:-\$PWD/([\w.-]+)\}", script.read_text())
    return found


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_scripts_default_output_folders_are_ignored() -> None:
    folders = _default_outputs()
    assert "gpu-results" in folders, folders
    for folder in folders:
        done = subprocess.run(
            ["git", "check-ignore", "-q", f"{folder}/summary.txt"], cwd=ROOT, capture_output=True, check=False
        )
        assert done.returncode == 0, f"{folder}/ (a default OUT in scripts/) is not in .gitignore"


def test_test_sh_says_what_it_installs_before_installing() -> None:
    text = (ROOT / "scripts" / "test.sh").read_text()
    notice = text.find("scripts/test.sh installs into")
    assert notice != -1 and notice < text.find("pip install"), "the notice must come before the first pip install"
    assert "1.7 GB" in text[notice:] and "PyTorch" in text[notice:] and "JAX" in text[notice:]
