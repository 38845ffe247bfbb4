"""``hvd.join``: a rank that has run out of data stands in with zeros for the allreduces the other
ranks still make, so ranks with uneven numbers of batches finish together (Horovod's semantics).

No exchange of its own before each call: a joined rank takes part in each call's own cross-rank check
(mpigpu.job.check) with a signature that says "join" and nothing else. The ranks still calling see a
difference, and every rank, joined or not, reads every rank's post from the same MismatchError
(``posted``). When the ranks still calling all asked for the same allreduce, every rank runs it again,
the joined ranks with zeros of its dtype and element count (hvd.Average still divides by the set's
size, as in Horovod); another collective raises HorovodInternalError on the ranks that made it; any
other difference is the MismatchError it was. While nobody has joined, a call costs what mpigpu's
call costs. With the check off (MPIGPU_CHECK=0) the layer posts each call's signature itself (``post``),
since nothing else would. A joined rank leaves ``join`` when every rank of the set has joined (the
check then agrees); all return the rank that joined last."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import mpigpu
from mpigpu.calls.pipeline import call
from mpigpu.calls.reduce import ALLREDUCE
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import MismatchError
from mpigpu.core.ops import Op
from mpigpu.core.typed import allreduce_int
from mpigpu.horovod._errors import HorovodInternalError
from mpigpu.horovod._state import ProcessSet, comm_of, global_process_set
from mpigpu.job.check import COLLECTIVES, FIELD, Signature, check_signature
from mpigpu.runtime.context import Context

__all__ = ["allreduce_standing_in", "join", "post", "refused_after_join"]

_JOIN, _ALLREDUCE = COLLECTIVES.index("join"), COLLECTIVES.index("allreduce")
_FAILED, _COUNT, _DTYPE, _OP, _KIND, _PLACEMENT = (
    FIELD[f] for f in ("failed", "count", "dtype", "op", "collective", "placement")
)
_BY_CODE = {d.code: d.name for d in DTYPES.values()}
_OPS = {o.code: o.value for o in Op}


def post(ctx: Context, sig: Signature) -> None:
    """With the check off (MPIGPU_CHECK=0, more than one rank): post ``sig`` in a cross-rank check of
    the layer's own, the point where a joined rank is found (MismatchError on every rank if any
    differs); with the check on, the call's own check does it."""
    if ctx.size > 1 and not ctx.settings.check:
        check_signature(ctx.comm, sig, COLLECTIVES[sig.collective])


def _asked(posted: Sequence[Sequence[int]]) -> Sequence[int] | None:
    """The allreduce every rank still calling asked for, when some rank has joined; else None."""
    calling = [v for v in posted if v[_KIND] != _JOIN]
    if calling and len(calling) < len(posted) and calling[0][_KIND] == _ALLREDUCE and calling[0][_FAILED] == 0:
        return calling[0] if all(v == calling[0] for v in calling) else None
    return None


def _allreduce_sig(count: int, dtype: int, op: int) -> Signature:
    return Signature(count, dtype, op, 0, 0, collective=_ALLREDUCE)


def allreduce_standing_in(
    comm: object, buffer: torch.Tensor, op: str, attempt: Callable[[], Any] | None = None
) -> None:
    """``mpigpu.allreduce(buffer, op)`` on ``comm`` (a process set's; ``attempt``: that call's check and
    launch, as ``allreduce_async`` started it); where ranks of the set have joined, again on ``buffer``
    flat, with their zeros (raises MismatchError as the call does otherwise)."""
    ctx = Context.get(comm)
    x = buffer
    while True:
        try:
            if ctx.size > 1 and not ctx.settings.check:
                d = DTYPES.get(str(x.dtype).removeprefix("torch."))
                post(ctx, _allreduce_sig(x.numel(), -1 if d is None else d.code, Op(op).code))
            if attempt is None:  # mpigpu.allreduce(x, op, comm=comm) on the one road, as allreduce_async's attempt
                call(ALLREDUCE, comm, None, (x, op, None, "auto"))
            else:
                attempt()
            return
        except MismatchError as exc:
            if _asked(exc.posted) is None:
                raise
            x, attempt = buffer.view(-1), None  # the joined ranks' zeros are flat


def _stand_in(ctx: Context, comm: object, asked: Sequence[int], place: torch.device) -> int:
    """A joined rank's side of the allreduce ``asked`` (zeros), again while more ranks join; the checks
    it posted."""
    posts = 0
    while True:
        posts += 1
        where = place
        if asked[_PLACEMENT] == 1 and place.type == "cpu" and ctx.gpu is not None:  # CUDA tensors: this rank's GPU
            where = torch.device("cuda", ctx.gpu.index)
        zeros = torch.zeros(int(asked[_COUNT]), dtype=getattr(torch, _BY_CODE[int(asked[_DTYPE])]), device=where)
        try:
            post(ctx, _allreduce_sig(*(int(asked[f]) for f in (_COUNT, _DTYPE, _OP))))
            mpigpu.allreduce(zeros, _OPS[int(asked[_OP])], comm=comm)
            return posts
        except MismatchError as exc:  # the ranks still calling raise it, or more ranks joined
            again = _asked(exc.posted)
            if again is None:
                return posts
            asked = again


@contextlib.contextmanager
def refused_after_join(process_set: ProcessSet, collective: str) -> Iterator[None]:
    """Around one non-allreduce call of the layer (mpigpu's ``collective``): HorovodInternalError on
    the ranks that make it when a rank of the set has joined (its own check finds the joined rank)."""
    try:
        post(Context.get(process_set.comm), Signature(0, 0, 0, 0, 0, collective=COLLECTIVES.index(collective)))
        yield
    except MismatchError as exc:
        if any(v[_KIND] == _JOIN for v in exc.posted):
            raise HorovodInternalError(
                "a rank of the process set has called hvd.join(): only allreduces continue until every rank has "
                "joined (Horovod's rule); make this call before join, on every rank"
            ) from None
        raise


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """Stand in with zeros for the allreduces the other ranks of the process set still make, until every
    rank has called join; return the rank (of the job) that joined last. ``device``: the GPU for the
    zeros, as in Horovod; -1 (the default): the CPU for CPU tensors, this rank's bound GPU where the
    ranks still calling reduce CUDA tensors (mpigpu reduces tensors of one placement)."""
    comm = comm_of(process_set)
    ctx = Context.get(comm)
    ctx.wait_async()  # this rank's own calls first
    place = torch.device("cpu") if device < 0 else torch.device("cuda", device)
    world = global_process_set.ranks or []
    me = world.index(process_set.ranks[comm.Get_rank()]) if process_set.ranks else comm.Get_rank()
    posts = 0  # checks posted since joining: the rank that joined last posted the fewest
    while True:
        posts += 1
        try:
            check_signature(ctx.comm, Signature(0, 0, 0, 0, 0, collective=_JOIN), "join")
            break  # every rank posted "join"
        except MismatchError as exc:
            asked = _asked(exc.posted)
            if asked is not None:
                posts += _stand_in(ctx, comm, asked, place)
    size = max(len(world), comm.Get_size())
    last = allreduce_int(process_set.control, me - posts * size, "max")  # fewest posts, then the highest rank
    return last % size
