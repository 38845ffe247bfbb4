"""The "mpigpu" process group: each c10d call handed to mpigpu's one road.

A ``dist.ProcessGroup`` subclass (torch calls its methods from Python and, through its C++
trampoline, from DDP's reducer and the functional collectives). Each method maps its tensors onto
one call of mpigpu's families (``mpigpu.calls``: allreduce, reduce_scatter, broadcast, allgather,
alltoall) and starts it as ``mpigpu.allreduce_async`` starts a call (``_work.start``): the same
argument check, the same choice of path, the same queue. The list forms gather into one flat buffer
and copy out where the call completes. What the backend itself refuses (an op or a form mpigpu has
not) joins the call's cross-rank check with its error (``mpigpu.calls.handles.reject``), so every
rank raises for that call and the next call pairs.

Each group works on its own communicator: a duplicate of the world for the default group, an
``MPI_Comm_create_group`` of its members for ``dist.new_group``; ``shutdown`` (called by
``dist.destroy_process_group``) closes mpigpu's context on it and frees it. A group whose backend
string gives some device to another backend (``"cpu:gloo,cuda:mpigpu"``) hands that device's calls to
that backend, made on first use over the group's store (torch keeps one Python process group per
group, not one per device)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d  # the options structs: torch 2.11 exports fewer of them
from torch.distributed import ReduceOp

from mpigpu.calls.handles import reject
from mpigpu.calls.move import ALLGATHER, ALLTOALL, BROADCAST
from mpigpu.calls.reduce import ALLREDUCE, REDUCE_SCATTER
from mpigpu.core._mpi import MPI
from mpigpu.core.errors import InvalidArgument, MismatchError
from mpigpu.runtime.context import ANY_THREAD, Context
from mpigpu.torch._work import done_work, joined, start

__all__ = ["ProcessGroupMpigpu", "create"]

_RED = ReduceOp.RedOpType
_OPS = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.PRODUCT: "prod", _RED.MIN: "min", _RED.MAX: "max"}
_HINTS = {
    _RED.PREMUL_SUM: "multiply the tensor by the factor, then all_reduce with ReduceOp.SUM",
    _RED.BAND: "bitwise reductions are not among mpigpu's ops",
    _RED.BOR: "bitwise reductions are not among mpigpu's ops",
    _RED.BXOR: "bitwise reductions are not among mpigpu's ops",
}


class ProcessGroupMpigpu(dist.ProcessGroup):
    """torch.distributed's process group over mpigpu (made by ``create``, registered as "mpigpu")."""

    def __init__(self, comm: Any, rank: int, size: int, timeout: timedelta, store: Any) -> None:
        super().__init__(rank, size)
        self._comm = comm  # ours: freed by shutdown
        self._store = store
        self._timeout = timeout
        self._name = ""
        self._others: dict[str, Any] = {}  # device type -> the backend a split backend string gives it
        ctx = Context.get(comm)  # collective: mpigpu's start-up on this group's communicator
        ctx.owner = ANY_THREAD  # DDP's reducer calls from autograd's threads; the queue keeps the order
        if timeout != dist.default_pg_timeout:  # given: a call of this group that outlasts it ends the job
            ctx.watchdog.set_timeout(timeout.total_seconds())

    def getBackendName(self) -> str:
        return "mpigpu"

    def _set_group_name(self, name: str) -> None:
        self._name = name  # torch names the group once made; the functional collectives find it by name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        return self._name

    # -- what the backend itself refuses, and calls another backend takes ----------------------------------
    def _refused(self, what: str, why: str) -> InvalidArgument:
        """InvalidArgument("what: why"), after it joined this call's cross-rank check (the other ranks
        raise for this call; the next call pairs)."""
        exc = InvalidArgument(f"{what}: {why}")
        ctx = Context.get(self._comm)
        ctx.enter(what)
        try:
            reject(ctx, exc)
        finally:
            ctx.leave()
        return exc

    def _op(self, what: str, op: Any) -> str:
        kind = op.op if hasattr(op, "op") else op
        name = _OPS.get(kind)
        if name is None:
            hint = _HINTS.get(kind, "use SUM, AVG, PRODUCT, MIN or MAX")
            raise self._refused(what, f"ReduceOp.{kind.name} is not supported by the mpigpu backend ({hint})")
        return name

    def _one(self, what: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(tensors) != 1:
            raise self._refused(what, f"the mpigpu backend takes one tensor per call, not {len(tensors)}")
        return tensors[0]

    def _dense(self, what: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if not t.is_contiguous():
                raise self._refused(what, "the tensor is not contiguous; pass t.contiguous()")

    @staticmethod
    def _apart(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``x``, or a copy of it where it shares memory with ``out``: torch lets an input be a view of the
        output (FSDP2 gathers in place, its shard at this rank's place in the output), which mpigpu
        refuses as an overlap."""
        if x.numel() and x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            return x.clone()
        return x

    def _other(self, tensor: torch.Tensor) -> Any:
        """The backend that takes ``tensor``'s device where the group's backend string gives it to
        another one (None: mpigpu's)."""
        kind = tensor.device.type
        if kind in self._others:
            return self._others[kind]
        other = None
        config = dict(part.split(":") for part in dist.get_backend_config(self).split(",") if ":" in part)
        name = config.get(kind, "mpigpu")
        if name == "gloo":
            store = dist.PrefixStore(f"mpigpu-{kind}/", self._store)
            other = dist.ProcessGroupGloo(store, self.rank(), self.size(), self._timeout)
        elif name == "nccl":
            store = dist.PrefixStore(f"mpigpu-{kind}/", self._store)
            other = dist.ProcessGroupNCCL(store, self.rank(), self.size())
        elif name != "mpigpu":
            raise ValueError(f"the mpigpu backend cannot hand {kind} tensors to backend {name!r} (gloo or nccl)")
        self._others[kind] = other
        return other

    # -- the reductions --------------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = c10d.AllreduceOptions() if opts is None else opts
        if tensors and (other := self._other(tensors[0])) is not None:
            return other.allreduce(tensors, opts)
        t = self._one("all_reduce", tensors)
        op = self._op("all_reduce", opts.reduceOp)
        self._dense("all_reduce", t)
        return start(ALLREDUCE, self._comm, (t, op, None, "auto"), [t])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """One allreduce of the tensors packed flat (they share a dtype and a device), unpacked after."""
        opts = c10d.AllreduceCoalescedOptions() if opts is None else opts
        if not tensors:
            return done_work([])
        if (other := self._other(tensors[0])) is not None:
            return other.allreduce_coalesced(tensors, opts)
        op = self._op("all_reduce_coalesced", opts.reduceOp)
        first = tensors[0]
        if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
            raise self._refused("all_reduce_coalesced", "the tensors must share one dtype and one device")
        flat = torch.cat([t.reshape(-1) for t in tensors])

        def unpack(_: Any) -> None:
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                t.copy_(part.view_as(t))

        return start(ALLREDUCE, self._comm, (flat, op, None, "auto"), tensors, unpack)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = c10d.ReduceScatterOptions() if opts is None else opts
        if (other := self._other(input)) is not None:
            return other._reduce_scatter_base(output, input, opts)
        op = self._op("reduce_scatter_tensor", opts.reduceOp)
        self._dense("reduce_scatter_tensor", output, input)
        if input.numel() != output.numel() * self.size() or input.dtype != output.dtype:
            why = f"input {input.numel()} x {input.dtype} must be world size ({self.size()}) x output's"
            raise self._refused("reduce_scatter_tensor", f"{why} {output.numel()} x {output.dtype}")
        # one row per rank: mpigpu's reduce_scatter gives rank r row r
        rows = self._apart(input, output).reshape(self.size(), -1)
        return start(REDUCE_SCATTER, self._comm, (rows, op, output.reshape(1, -1), "auto"), [output])

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        opts = c10d.ReduceScatterOptions() if opts is None else opts
        output = self._one("reduce_scatter", outputs)
        if (other := self._other(output)) is not None:
            return other.reduce_scatter(outputs, inputs, opts)
        parts = inputs[0] if len(inputs) == 1 else []
        if len(parts) != self.size() or any(p.numel() != output.numel() or p.dtype != output.dtype for p in parts):
            raise self._refused("reduce_scatter", f"pass one list of {self.size()} inputs of output's size and dtype")
        return self._reduce_scatter_base(output, torch.cat([p.reshape(-1) for p in parts]), opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:  # fmt: skip
        return joined([self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """mpigpu's allreduce (the same bits on every rank); the root keeps the result."""
        opts = c10d.ReduceOptions() if opts is None else opts
        if tensors and (other := self._other(tensors[0])) is not None:
            return other.reduce(tensors, opts)
        t = self._one("reduce", tensors)
        op = self._op("reduce", opts.reduceOp)
        self._dense("reduce", t)
        result = torch.empty_like(t)
        root = opts.rootRank

        def keep(_: Any) -> None:
            if self.rank() == root:
                t.copy_(result)

        return start(ALLREDUCE, self._comm, (t, op, result, "auto"), [t], keep)

    # -- data movement -------------------------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = c10d.BroadcastOptions() if opts is None else opts
        if tensors and (other := self._other(tensors[0])) is not None:
            return other.broadcast(tensors, opts)
        t = self._one("broadcast", tensors)
        self._dense("broadcast", t)
        return start(BROADCAST, self._comm, (t, opts.rootRank, "auto"), [t])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = c10d.AllgatherOptions() if opts is None else opts
        if (other := self._other(input)) is not None:
            return other._allgather_base(output, input, opts)
        self._dense("all_gather_into_tensor", output, input)
        x = self._apart(input, output).reshape(-1)
        return start(ALLGATHER, self._comm, (x, output.reshape(-1), "auto"), [output])

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:  # fmt: skip
        return joined([self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        """Every rank's input (its own size) gathered flat, then copied into the output list."""
        opts = c10d.AllgatherOptions() if opts is None else opts
        t = self._one("all_gather", inputs)
        if (other := self._other(t)) is not None:
            return other.allgather(outputs, inputs, opts)
        parts = outputs[0] if len(outputs) == 1 else []
        if len(parts) != self.size() or any(p.dtype != t.dtype or p.device != t.device for p in parts):
            raise self._refused("all_gather", f"pass one list of {self.size()} outputs of the input's dtype and device")
        flat = torch.empty(sum(p.numel() for p in parts), dtype=t.dtype, device=t.device)
        return start(ALLGATHER, self._comm, (t.contiguous().reshape(-1), flat, "auto"), parts,
                     lambda _: _unpack(flat, parts))  # fmt: skip

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:  # fmt: skip
        """all_gather_coalesced: one list-form allgather per input (``outputs[r][j]``: rank r's j-th)."""
        if len(outputs) != self.size() or any(len(o) != len(inputs) for o in outputs):
            raise self._refused("all_gather_coalesced", f"pass {self.size()} output lists of {len(inputs)} tensors")
        return joined([self.allgather([[o[j] for o in outputs]], [t], opts) for j, t in enumerate(inputs)])

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        """mpigpu's allgather; the root copies the rows into its output list."""
        opts = c10d.GatherOptions() if opts is None else opts
        t = self._one("gather", inputs)
        if (other := self._other(t)) is not None:
            return other.gather(outputs, inputs, opts)
        parts = outputs[0] if self.rank() == opts.rootRank and len(outputs) == 1 else []
        return start(ALLGATHER, self._comm, (t.contiguous().reshape(-1), None, "auto"), parts,
                     lambda gathered: _unpack(gathered, parts))  # fmt: skip

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        """mpigpu's alltoall in which only the root sends: its i-th tensor to rank i."""
        opts = c10d.ScatterOptions() if opts is None else opts
        out = self._one("scatter", outputs)
        if (other := self._other(out)) is not None:
            return other.scatter(outputs, inputs, opts)
        self._dense("scatter", out)
        if self.rank() == opts.rootRank:
            parts = inputs[0] if len(inputs) == 1 else []
            if len(parts) != self.size():
                raise self._refused("scatter", f"the root passes {self.size()} tensors")
            x = torch.cat([p.reshape(-1).to(out.dtype) for p in parts])
            splits = [p.numel() for p in parts]
        else:
            x, splits = out.new_empty(0), [0] * self.size()
        return start(ALLTOALL, self._comm, (x, splits, out.reshape(-1), "auto", False), [out])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], opts: Any = None) -> Any:  # fmt: skip
        """all_to_all_single: rows of the first dimension, as mpigpu's alltoall sends them. The rows
        received are checked against ``output_splits`` where given (a rank whose splits disagree raises
        MismatchError after the call; every rank has made it, so the next call pairs)."""
        opts = c10d.AllToAllOptions() if opts is None else opts
        if (other := self._other(input)) is not None:
            return other.alltoall_base(output, input, output_splits, input_splits, opts)
        self._dense("all_to_all_single", output, input)
        splits = list(input_splits) if input_splits else None
        expected = list(output_splits) if output_splits else None

        def agree(result: Any) -> None:
            received = list(result[1])
            if expected is not None and received != expected:
                raise MismatchError(f"all_to_all_single: output_split_sizes {expected} but the ranks sent {received}")

        x = self._apart(input, output)
        return start(ALLTOALL, self._comm, (x, splits, output, "auto", True), [output], agree)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        """all_to_all (lists): the inputs sent flat (tensor i to rank i), the rows received unpacked."""
        opts = c10d.AllToAllOptions() if opts is None else opts
        if inputs and (other := self._other(inputs[0])) is not None:
            return other.alltoall(outputs, inputs, opts)
        if len(inputs) != self.size() or len(outputs) != self.size():
            raise self._refused("all_to_all", f"pass {self.size()} inputs and {self.size()} outputs")
        x = torch.cat([t.reshape(-1) for t in inputs])
        flat = torch.empty(sum(t.numel() for t in outputs), dtype=x.dtype, device=x.device)
        return start(ALLTOALL, self._comm, (x, [t.numel() for t in inputs], flat, "auto", False), outputs,
                     lambda _: _unpack(flat, outputs))  # fmt: skip

    def barrier(self, opts: Any = None) -> Any:
        """An allreduce of one int on the host: every rank's ``wait()`` returns once all have called."""
        return start(ALLREDUCE, self._comm, (torch.zeros(1, dtype=torch.int32), "sum", None, "auto"), [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        raise _no_point_to_point("send")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        raise _no_point_to_point("recv")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise _no_point_to_point("recv")

    # torch 2.13's names of the single-tensor forms (2.11 calls the ones above)
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # -- the end ----------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close mpigpu's context on this group's communicator and free it (collective: torch destroys
        groups in one order on every rank). Idempotent."""
        comm, self._comm = self._comm, None
        if comm is None:
            return
        for other in self._others.values():
            if other is not None and hasattr(other, "shutdown"):
                other.shutdown()
        Context.get(comm).close()
        comm.Free()

    def abort(self) -> None:
        self.shutdown()


def _unpack(flat: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Copy ``flat``'s consecutive pieces into ``parts`` (each its own size)."""
    flat = flat.reshape(-1)
    if flat.numel() != sum(p.numel() for p in parts) and parts:
        raise MismatchError(f"the ranks sent {flat.numel()} elements, the outputs hold {sum(p.numel() for p in parts)}")
    offset = 0
    for p in parts:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def _no_point_to_point(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what}: the mpigpu backend has no point-to-point path (mpigpu's road carries collectives only); "
        'give the device another backend for it, e.g. dist.new_group(backend="gloo")'
    )


def create(opts: Any, backend_options: Any = None) -> ProcessGroupMpigpu:
    """torch's creator (``register_backend(..., extended_api=True)``): the group's communicator from
    MPI (a duplicate of the world for the default group, its members' group for a subgroup), then
    the group over it. Collective over the group's members."""
    mpi = MPI()
    world = mpi.COMM_WORLD
    ranks = [int(r) for r in opts.global_ranks_in_group]
    if not ranks or ranks == list(range(world.Get_size())):
        differs = opts.group_rank != world.Get_rank() or opts.group_size != world.Get_size()
        if world.allreduce(int(differs), op=mpi.MAX):
            raise ValueError(
                f"the mpigpu backend's default group must be MPI's world: torch says rank {opts.group_rank} of "
                f"{opts.group_size}, MPI says {world.Get_rank()} of {world.Get_size()} (init with "
                "mpigpu.torch.init_process_group, or with no RANK/WORLD_SIZE that differ from MPI's)"
            )
        comm = world.Dup()
    else:
        group = world.Get_group().Incl(ranks)
        try:
            comm = world.Create_group(group, tag=0)  # collective over the members only
        finally:
            group.Free()
        if comm.Get_rank() != opts.group_rank:
            raise ValueError(f"torch's group rank {opts.group_rank} is not MPI's {comm.Get_rank()} for {ranks}")
    return ProcessGroupMpigpu(comm, opts.group_rank, opts.group_size, opts.timeout, opts.store)
