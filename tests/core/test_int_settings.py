"""Integer MPIGPU_* settings are parsed and range-checked: a value past the range (2**63, which no
int64 holds, or a number of thousands of digits) is a ConfigError naming the variable, the value and
the range, never an OverflowError or a ValueError (issue 30: a raw OverflowError on one rank, raised
after the settings were read, left the other ranks waiting in the start-up exchange)."""

from __future__ import annotations

import pytest

from mpigpu.core.config import ENV_VARS, INT_RANGES, Settings, parse_count
from mpigpu.core.errors import ConfigError, InvalidArgument

PATHS = {"MPIGPU_CACHE_DIR", "MPIGPU_TUNE_FILE", "MPIGPU_TIMELINE"}  # any text is a path there


@pytest.mark.parametrize("variable", sorted(INT_RANGES))
@pytest.mark.parametrize("value", [str(2**63), str(2**64 + 1), "9" * 5000, "99999999999T"])
def test_a_huge_integer_setting_is_a_config_error_with_the_range(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        Settings.from_env()
    message = str(info.value)
    low, high = INT_RANGES[variable]
    assert f"{variable}=" in message and value[:20] in message and f"from {low} to {high}" in message, message


PER_RANK = {
    "MPIGPU_DEVICES_PER_RANK": lambda settings: settings.devices_per_rank,
    "MPIGPU_TIMELINE_EVENTS": lambda settings: settings.timeline_events,
}


@pytest.mark.parametrize("variable", sorted(INT_RANGES))
def test_each_end_of_the_range_is_taken_and_one_past_it_is_not(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    low, high = INT_RANGES[variable]
    for good in (low, high):
        monkeypatch.setenv(variable, str(good))
        settings = Settings.from_env()
        agreed = dict(settings.agreed())
        if variable in agreed:
            assert agreed[variable] == good, variable
        else:  # per rank on purpose (MPIGPU_DEVICES_PER_RANK): the value itself is taken
            assert PER_RANK[variable](settings) == good, variable
    for bad in (low - 1, high + 1):
        monkeypatch.setenv(variable, str(bad))
        with pytest.raises(ConfigError, match=f"{variable}='{bad}' is not valid"):
            Settings.from_env()


def test_every_agreed_value_fits_an_int64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up sends them in one MPI_Allgather of int64: the largest values must fit."""
    for variable, (_, high) in INT_RANGES.items():
        monkeypatch.setenv(variable, str(high))
    assert all(v is None or -(2**63) <= v < 2**63 for _, v in Settings.from_env().agreed())  # type: ignore[operator]


@pytest.mark.parametrize("variable", sorted(set(ENV_VARS) - PATHS))
def test_no_setting_takes_two_to_the_63(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """Every non-path variable, integer or not, refuses 2**63 with a ConfigError naming it."""
    monkeypatch.setenv(variable, str(2**63))
    with pytest.raises(ConfigError, match=variable):
        Settings.from_env()


def test_parse_count_refuses_numbers_too_long_for_int() -> None:
    with pytest.raises(InvalidArgument, match="more than 30 digits"):
        parse_count("1" * 5000)
