"""Cross-rank argument check: every rank learns, before any data moves, whether all ranks called
the collective with the same count, dtype, op, backend and data placement, or whether a rank
rejected its own arguments. Mismatches become the same MismatchError on every rank instead of a
hang or a read past a buffer. The shape is checked too (as a 62-bit hash): ranks that pass the same
element count in different shapes are almost certainly reducing different tensors into each other.

How: when every rank of the communicator is on one node (the usual GPU box), through node-shared
memory (mpigpu/job/check_board.py): each rank posts its 9 values and reads everyone's, no MPI call;
across nodes, every rank's slot moved by one MPI_Allgather(v) among the node leaders between node-shared
posts (mpigpu/job/node_mpi_board.py), or over all ranks where each node holds one (mpigpu/job/mpi_board.py;
the same interface: a tiny allreduce's data travels in it); past its MAX_RANKS, or on a communicator that has no board,
one MPI_Allreduce(MAX) of 18 int64 values ([v, -v]). On a difference, either way, every rank gathers
the signatures (MPI) and raises the same message. A caller that checks the same signature on many
calls (a call record) packs it once and posts the packed bytes (``check_packed``): the same check,
every field compared on every call, without rebuilding the values. It runs on every call, by design: any
scheme where ranks skip the check independently (say, once per signature seen) can leave one rank
checking while another has moved on, which is the hang the check exists to prevent. Example: rank 0
has seen (1000, float32) before and skips; rank 1 passes 1001 for the first time and checks, so
rank 1 waits in the check while rank 0 is already in the data collective. MPIGPU_CHECK=0 turns it
off for production runs whose call sequence has been validated with it on.

``fail_together`` is the same mechanism for a step that can fail on some ranks only (a backend's
set-up, ``mpigpu.jax.init``): every rank learns of the failure instead of waiting for the rank that
failed.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any, NamedTuple, NoReturn

from mpigpu.core._mpi import MPI
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import MismatchError
from mpigpu.core.ops import Op
from mpigpu.job.check_board import FIELDS, Board, board_for, pack

__all__ = [
    "COLLECTIVES",
    "FIELD",
    "Signature",
    "check_packed",
    "check_rows",
    "check_signature",
    "fail_together",
    "mark_raised_everywhere",
    "raise_mismatch",
]

_FIELDS = ("failed", "count", "dtype", "op", "backend", "placement", "shape", "collective", "root")
assert len(_FIELDS) == FIELDS, "the check board's slots hold one value per field"
FIELD = {name: index for index, name in enumerate(_FIELDS)}  # a field's index in Signature.values()
# A collective's code in the signature is its index here: one collective per call, and two ranks in
# different collectives fail the check like any other difference.
COLLECTIVES: tuple[str, ...] = (
    "allreduce", "broadcast", "allgather", "broadcast_object", "allgather_object", "reduce_scatter", "alltoall",
    "allreduce over devices", "join", "barrier",
)  # fmt: skip
_ZEROS = bytes(16 * len(_FIELDS))  # [v, -v] as int64 (array.array: cheaper per call than NumPy here)


class Signature(NamedTuple):
    """What one rank asked for. ``error`` is set when the rank rejected its own arguments.

    A NamedTuple, not a dataclass: it is built on every call, and this is 5x cheaper."""

    count: int
    dtype: int  # DType.code
    op: int  # Op.code
    backend: int  # Backend.code
    placement: int  # 0 host, 1 GPU, 2 host in Fortran order (ArrayView.placement)
    error: str | None = None
    shape: tuple[int, ...] = ()
    collective: int = 0  # index in COLLECTIVES
    root: int = 0  # the root rank (broadcast); 0 for collectives without one

    def values(self) -> list[int]:
        """The checked fields, in _FIELDS order."""
        return [
            1 if self.error else 0, self.count, self.dtype, self.op, self.backend, self.placement,
            shape_hash(self.shape), self.collective, self.root,
        ]  # fmt: skip

    def packed(self) -> bytes:
        """The values as the check board stores them, for ``check_packed`` (a signature that passed
        its own validation: the failed flag is 0)."""
        assert not self.error, "a rejection is posted through check_signature"
        return pack(self.values())


_SHAPE_HASHES: dict[tuple[int, ...], int] = {}


def shape_hash(shape: tuple[int, ...]) -> int:
    """A hash of the shape that is the same in every process (Python's hash() is salted per process),
    in 62 bits so that -v fits an int64. Cached: a training loop repeats a few shapes."""
    value = _SHAPE_HASHES.get(shape)
    if value is None:
        text = ",".join(str(int(d)) for d in shape).encode()
        value = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2
        if len(_SHAPE_HASHES) >= 4096:
            _SHAPE_HASHES.clear()
        _SHAPE_HASHES[shape] = value
    return value


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _label(field: str, value: Any) -> str:
    if field == "dtype":
        return next((d.name for d in DTYPES.values() if d.code == value), str(value))
    if field == "op":
        return next((o.value for o in Op if o.code == value), str(value))
    if field == "placement":
        return {0: "host array", 1: "GPU array", 2: "Fortran-order host array"}.get(value, str(value))
    if field == "shape":
        return "[" + ", ".join(map(str, value)) + "]"
    if field == "collective" and 0 <= value < len(COLLECTIVES):
        return COLLECTIVES[value]
    return str(value)


# what each collective's ranks must agree on, as its mismatch message says it (a reduction has no root)
_MUST_AGREE = {
    "allreduce": "shape, dtype, op, placement and backend",
    "broadcast": "shape, dtype, root, placement and backend",
    "allgather": "dtype, placement, backend and shape after the first dimension",
    "broadcast_object": "root",
    "allgather_object": "collective",
    "barrier": "collective",
}


Gathered = tuple[list[int], str | None, tuple[int, ...], str, tuple[int, ...]]  # values, error, shape, backend, own


def _own_call(vec: list[int], own: tuple[int, ...], backend: str) -> str:
    """One rank's call as its caller wrote it: the collective, x's own shape, dtype, op where it has one,
    root, placement and backend (the signature's fields stand for other things in other collectives)."""
    field = dict(zip(_FIELDS, vec, strict=True))
    collective = _label("collective", field["collective"])
    args = [f"x {_label('shape', own)} {_label('dtype', field['dtype'])}"]
    if field["op"]:
        args.append(f"op={_label('op', field['op'])}")
    if collective == "broadcast":
        args.append(f"root={field['root']}")
    args.append(_label("placement", field["placement"]))
    args.append(f"backend {backend or field['backend']}")
    return f"{collective}({', '.join(args)})"


def _describe(name: str, gathered: list[Gathered], failure: str) -> str:
    failed = [(r, err) for r, (_, err, _, _, _) in enumerate(gathered) if err]
    if failed:
        lines = [f"rank {r}: {err}" for r, err in failed]
        return f"{name} did not run: {_ranks([r for r, _ in failed])} {failure}.\n  " + "\n  ".join(lines)
    # different calls (a rank in Horovod's join stands in for any): each rank's own arguments
    if len({vec[FIELD["collective"]] for vec, *_ in gathered} - {COLLECTIVES.index("join")}) > 1:
        calls: dict[str, list[int]] = {}
        for r, (vec, _, _, backend, own) in enumerate(gathered):
            calls.setdefault(_own_call(vec, own, backend), []).append(r)
        shown = "; ".join(f"{_ranks(rs)} {call}" for call, rs in calls.items())
        return f"{name}: ranks called different collectives ({shown}). Every rank must make the same call."
    parts = []
    for index, field in enumerate(_FIELDS):
        if field == "failed":
            continue
        by_value: dict[Any, list[int]] = {}
        for r, (vec, _, shape, _, _) in enumerate(gathered):
            by_value.setdefault(shape if field == "shape" else vec[index], []).append(r)
        if len(by_value) > 1:
            labels = {vec[index]: backend for vec, _, _, backend, _ in gathered} if field == "backend" else {}
            shown = "; ".join(f"{labels.get(v) or _label(field, v)} on {_ranks(rs)}" for v, rs in by_value.items())
            parts.append(f"{field}: {shown}")
    if not parts:
        parts.append("arguments differ")
    return (
        f"{name}: ranks passed different arguments ({' | '.join(parts)}). "
        f"Every rank must call it with the same {_MUST_AGREE.get(name, _MUST_AGREE['allreduce'])}."
    )


def check_signature(
    comm: Any,
    sig: Signature,
    name: str = "allreduce",
    failure: str = "rejected the arguments",
    backend_name: str = "",
    shape: tuple[int, ...] | None = None,
) -> None:
    """Raise MismatchError (the same text on every rank) unless all ranks fail_together and none failed.

    ``failure`` completes "<name> did not run: rank 1 ..." when a rank reports an error;
    ``backend_name`` names ``sig.backend`` in that message (this module sits below the backends);
    ``shape``: x's own shape, which the message shows where ranks called different collectives
    (default ``sig.shape``)."""
    mine = sig.values()
    board = board_for(comm)
    if board is not None:
        if board.agree(mine):
            return
        _mismatch(comm, sig, mine, name, failure, backend_name, shape)
    result = _max_and_min(comm, mine)
    # max - min >= 0 per field, so all fields agree iff the results sum to 0; result[0] is 1 if any rank failed
    if result[0] == 0 and sum(result) == 0:
        return
    _mismatch(comm, sig, mine, name, failure, backend_name, shape)


def check_packed(comm: Any, board: Board | None, sig: Signature, packed: bytes, backend_name: str = "") -> None:
    """``check_signature(comm, sig, backend_name=backend_name)`` for an allreduce whose signature was
    packed before (``sig.packed()``); ``board`` is ``comm``'s (``board_for(comm)``, or None: MPI). The
    hot path of a repeated call: every field is still compared on every rank, on every call."""
    if board is not None:
        if board.agree_packed(packed):
            return
        raise_mismatch(comm, sig, backend_name)
    check_signature(comm, sig, backend_name=backend_name)


def raise_mismatch(
    comm: Any, sig: Signature, backend_name: str = "", name: str = "allreduce", shape: tuple[int, ...] | None = None
) -> NoReturn:
    """After the board found that the ranks' signatures of collective ``name`` differ (every rank
    found it): gather them and raise the same MismatchError on every rank (collective). ``shape``: as
    in check_signature."""
    _mismatch(comm, sig, sig.values(), name, "rejected the arguments", backend_name, shape)


def _max_and_min(comm: Any, mine: list[int]) -> array:
    """MPI_Allreduce(MAX) of [v, -v] (collective): result[i] is field i's maximum over the ranks and
    -result[FIELDS + i] its minimum, both in one collective of 18 int64."""
    mpi = MPI()
    result = array("q", _ZEROS)
    comm.Allreduce([array("q", mine + [-v for v in mine]), mpi.INT64_T], [result, mpi.INT64_T], mpi.MAX)
    return result


_ROOT = _FIELDS.index("root")


def check_rows(
    comm: Any, sig: Signature, name: str = "allgather", backend_name: str = "", shape: tuple[int, ...] | None = None
) -> list[int] | None:
    """check_signature for allgather, whose ``root`` field carries this rank's first dimension, which
    may differ between ranks (collective). MismatchError on every rank as check_signature raises it
    when a rank failed or any other field differs; else every rank's first dimension, in rank order,
    when this one exchange tells it (all equal, or read from the check board), or None when they
    differ and must be gathered. Every rank returns alike: they all read the same exchange. ``shape``:
    as in check_signature."""
    mine = sig.values()
    board = board_for(comm)
    if board is not None:
        if board.agree(mine):
            return [sig.root] * board.size
        posted = board.posted()
        strip = [v[:_ROOT] + v[_ROOT + 1 :] for v in posted]
        if posted[0][0] == 0 and all(v == strip[0] for v in strip):
            return [v[_ROOT] for v in posted]
    else:
        result = _max_and_min(comm, mine)
        spread = [result[i] + result[i + FIELDS] for i in range(FIELDS)]  # max - min of each field
        if result[0] == 0 and sum(spread) == spread[_ROOT]:
            return [sig.root] * comm.Get_size() if spread[_ROOT] == 0 else None
    sig = sig._replace(root=0)  # the message names the fields that must agree, not the first dimension
    _mismatch(comm, sig, sig.values(), name, "rejected the arguments", backend_name, shape)


def _mismatch(
    comm: Any, sig: Signature, mine: list[int], name: str, failure: str, backend_name: str,
    shape: tuple[int, ...] | None = None,
) -> NoReturn:  # fmt: skip
    """Every rank found a difference: gather the signatures and raise the same message everywhere (collective)."""
    checked = tuple(int(d) for d in sig.shape)
    own = checked if shape is None else tuple(int(d) for d in shape)
    gathered = comm.allgather((mine, sig.error, checked, backend_name, own))
    error = MismatchError(_describe(name, gathered, failure))
    error.posted = tuple(tuple(vec) for vec, *_ in gathered)
    raise mark_raised_everywhere(comm, error)


def mark_raised_everywhere(comm: Any, error: BaseException, *, same_text: bool = False) -> BaseException:
    """Note on ``error`` that every rank of the job raises for this same call (``comm`` spans the job):
    failsafe then reports it once and ends the ranks together, without MPI_Abort. ``same_text``: every
    rank raises this very error and message (rank 0 prints it). Returns ``error``."""
    if comm.Get_size() == MPI().COMM_WORLD.Get_size():
        error.mpigpu_everywhere = True  # type: ignore[attr-defined]
        error.mpigpu_same_text = same_text  # type: ignore[attr-defined]
    return error


def fail_together(comm: Any, error: BaseException | None, name: str) -> None:
    """Collective: if ``error`` is set on any rank, raise on every rank (the failing rank raises its own
    error, the others a MismatchError naming it and its message); otherwise return."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    try:
        check_signature(comm, Signature(0, 0, 0, 0, 0, error=text), name, failure="failed")
    except MismatchError:
        if error is not None:
            raise mark_raised_everywhere(comm, error) from None
        raise
