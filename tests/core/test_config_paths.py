"""Paths in MPIGPU_CACHE_DIR and MPIGPU_TUNE_FILE: a ``~user`` that does not exist is a ConfigError
naming the variable (on every rank of a job, not a pathlib traceback), and a user with no home
directory still gets a cache directory that works."""

from __future__ import annotations

import os
import pwd
import tempfile
from pathlib import Path

import pytest
from conftest import run_mpi

from mpigpu.core.config import Settings
from mpigpu.core.errors import ConfigError

NO_USER = "~mpigpu-no-such-user-27/cache"


@pytest.mark.parametrize("variable", ["MPIGPU_CACHE_DIR", "MPIGPU_TUNE_FILE"])
def test_tilde_of_an_unknown_user_names_the_variable(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, NO_USER)
    with pytest.raises(ConfigError, match=rf"{variable}='{NO_USER}' is not valid: .*absolute path"):
        Settings.from_env()


def test_no_home_gives_a_private_cache_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HOME and no password entry (a container's anonymous uid): pathlib cannot find a home."""
    for variable in ("HOME", "XDG_CACHE_HOME", "MPIGPU_CACHE_DIR", "MPIGPU_TUNE_FILE"):
        monkeypatch.delenv(variable, raising=False)

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(uid)

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    settings = Settings.from_env()
    assert settings.cache_dir == Path(tempfile.gettempdir()) / f"mpigpu-cache-{os.geteuid()}"
    assert settings.tune_path.parent == settings.cache_dir
    with pytest.raises(ConfigError, match="MPIGPU_TUNE_FILE"):  # and ~ in a variable is the clear error
        monkeypatch.setenv("MPIGPU_TUNE_FILE", "~/tune.json")
        Settings.from_env()


SCRIPT = """
import os
import numpy as np, mpigpu
from mpigpu.core.errors import ConfigError
try:
    mpigpu.allreduce(np.ones(4), backend="cpu")
except ConfigError as exc:
    os.write(1, f"ConfigError: {exc}\\n".encode())  # one write: ranks' lines do not interleave
    raise SystemExit(3)
"""


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_raises_the_config_error(n: int) -> None:
    result = run_mpi(n, ["-c", SCRIPT], timeout=60, env={"MPIGPU_CACHE_DIR": NO_USER, "MPIGPU_ABORT_ON_EXCEPTION": "0"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("ConfigError: MPIGPU_CACHE_DIR=")]
    assert len(lines) == n, result.stdout + result.stderr
    assert "RuntimeError" not in result.stderr, result.stderr
    assert result.returncode != 0
