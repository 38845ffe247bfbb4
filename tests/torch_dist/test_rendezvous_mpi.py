"""mpigpu.torch's rendezvous from MPI: a rank that refuses the store's directory makes every rank raise."""

from __future__ import annotations

from datetime import timedelta

import pytest

pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")

from mpigpu.torch import _rendezvous

pytestmark = pytest.mark.mpi


@pytest.mark.mpi(min_size=2)
def test_a_directory_one_rank_refuses_raises_on_every_rank(comm, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _rendezvous._private_dir

    def refuse_on_the_last_rank(path: str) -> str:
        if comm.Get_rank() == comm.Get_size() - 1:
            raise ValueError(f"the rendezvous directory {path} is not a private (0700) directory of this user")
        return real(path)

    monkeypatch.setattr(_rendezvous, "_private_dir", refuse_on_the_last_rank)
    with pytest.raises(ValueError, match="rendezvous did not start: the rendezvous directory"):
        _rendezvous._file_store(comm, timedelta(seconds=30))
    monkeypatch.setattr(_rendezvous, "_private_dir", real)
    store = _rendezvous._file_store(comm, timedelta(seconds=30))  # the next rendezvous pairs
    store.set(f"rank{comm.Get_rank()}", "ok")
    assert [store.get(f"rank{r}") for r in range(comm.Get_size())] == [b"ok"] * comm.Get_size()
