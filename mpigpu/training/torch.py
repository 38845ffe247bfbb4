"""Average a PyTorch model's gradients while ``backward()`` is still running, as DDP does.

    averager = BackwardAverager(model, optimizer=optimizer)   # once, after building the optimizer
    loss.backward()                                           # buckets are sent as their gradients
    optimizer.step()                                          # finish() runs first: grads averaged

Parameters are bucketed in reverse order (the order backward usually produces their gradients), 25
MiB per bucket by default and 1 MiB for the first (DDP's), so the first gradients leave early. After
the first averaged step the buckets are rebuilt once in the order the gradients actually arrived
(as DDP rebuilds its buckets): rank 0's order, agreed collectively, so a model whose forward uses
its layers in another order than they were registered still sends its first gradients first. A hook on
each parameter (``register_post_accumulate_grad_hook``, PyTorch >= 2.1) counts the bucket's ready
gradients; when a bucket is complete it is packed and its
``allreduce_async`` starts, while backward computes the next gradients. Buckets start strictly in
order, so every rank issues the same collectives in the same order even if its gradients arrive in
a different one. ``finish()`` (or the optimizer's step, when given) starts what is left, waits, and
leaves each ``p.grad`` holding the average (a view of its bucket unless compressed).

CUDA tensors: the reductions run on a side stream that waits for the packing; ``finish()`` makes
the compute stream wait for them, so later kernels see the averages. CPU tensors: the reductions
run on mpigpu's background MPI thread, overlapping the rest of backward.

Threads: with CUDA tensors autograd runs the hooks on its own device thread, while ``finish()``
runs on the caller's. The BackwardAverager therefore works on its own duplicate of ``comm`` (made
at construction, collectively; freed by ``close()``), exempt from mpigpu's one-thread rule: its
buckets start strictly in order whichever thread starts them. Other calls on ``comm`` follow the
rule as usual.

Parameters that receive no gradient in a step hold their bucket (and the later ones) back until
``finish()``, which sends zeros for them. For gradient accumulation, run the accumulating
backward passes inside ``with averager.no_sync():``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

from mpigpu.core import timeline
from mpigpu.core.errors import InvalidArgument, MpigpuError
from mpigpu.training import timeline_marks
from mpigpu.training.averager import Averager
from mpigpu.training.broadcast_state import broadcast_parameters

__all__ = ["DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES", "BackwardAverager"]

DDP_BUCKET_BYTES = 25 << 20
DDP_FIRST_BUCKET_BYTES = 1 << 20  # the last layers' gradients, ready first, leave early (DDP's first bucket)


class BackwardAverager:
    """Average the gradients of ``model`` (a torch.nn.Module or an iterable of parameters) across
    ranks, bucket by bucket, during backward(). Collective to build, like ``Averager``.

    optimizer:    if given, ``finish()`` runs automatically before each ``optimizer.step()``.
    bucket_bytes, first_bucket_bytes, compression, backend, comm: as for ``mpigpu.Averager`` (the
    defaults are DDP's: 25 MiB, the first bucket 1 MiB).
    broadcast:    True (default): every rank starts from rank 0's parameters (and buffers, for a
                  Module), as DDP does; False skips it.
    """

    def __init__(
        self,
        model: Any,
        *,
        optimizer: Any = None,
        bucket_bytes: int | str = DDP_BUCKET_BYTES,
        first_bucket_bytes: int | str | None = DDP_FIRST_BUCKET_BYTES,
        compression: str | None = None,
        backend: str = "auto",
        comm: Any = None,
        broadcast: bool = True,
    ) -> None:
        import torch

        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise InvalidArgument(f"BackwardAverager needs PyTorch >= 2.1 (this is {torch.__version__})")
        is_module = isinstance(model, torch.nn.Module)
        params: list[Any] = list(model.parameters() if is_module else model)
        self._trainable = [p for p in params if p.requires_grad]
        self._order = list(range(len(self._trainable)))[::-1]  # backward produces gradients last-first, usually
        self._settings = {"bucket_bytes": bucket_bytes, "first_bucket_bytes": first_bucket_bytes,
                          "compression": compression, "backend": backend}  # fmt: skip
        self._comm = _private_comm(comm)
        try:
            # broadcast below: the whole model (buffers too), after the layout check
            self._averager = self._new_averager(self._order)
            if broadcast:
                broadcast_parameters(model if is_module else params, 0, comm=self._comm)
        except BaseException:
            self._comm.Free()  # every rank fails the (collective) construction together
            raise
        self._index_buckets()
        self._next = 0  # the first bucket not started this step
        self._syncing = True
        self._observed: list[int] | None = []  # the gradients' order in the first averaged step; None: rebuilt
        self._hooks = [
            p.register_post_accumulate_grad_hook(partial(self._on_grad, i)) for i, p in enumerate(self._trainable)
        ]
        self._tl_first: int | None = None  # the timeline: this step's first and last gradient (ns)
        self._tl_last: int | None = None
        self._tl_step_began = 0
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))
            if timeline.on:  # timeline hook: the optimizer's step as a span
                self._hooks.append(optimizer.register_step_post_hook(self._after_step))

    def _new_averager(self, order: list[int]) -> Averager:
        """An Averager of the trainable parameters in ``order`` (collective: every rank the same order)."""
        return Averager([self._trainable[i] for i in order], comm=self._comm, broadcast=False, **self._settings)

    def _index_buckets(self) -> None:
        """The bucket of each parameter (by its position among the trainable ones) and each bucket's size."""
        members = self._averager.bucket_members
        self._bucket_of = [0] * len(self._trainable)
        for bucket, indices in enumerate(members):
            for index in indices:
                self._bucket_of[self._order[index]] = bucket
        self._sizes = [len(indices) for indices in members]
        self._ready = [0] * len(members)

    @property
    def buckets(self) -> list[dict[str, Any]]:
        """One dict per bucket, in the order they are sent (see ``Averager.buckets``)."""
        return self._averager.buckets

    @property
    def bucket_parameters(self) -> list[list[int]]:
        """Per bucket, in the order they are sent, the positions of its parameters among the model's
        trainable parameters (``[p for p in model.parameters() if p.requires_grad]``)."""
        return [[self._order[i] for i in indices] for indices in self._averager.bucket_members]

    def _on_grad(self, index: int, _param: Any) -> None:
        if not self._syncing:
            return
        if self._observed is not None:
            self._observed.append(index)
        if not self._averager.step_in_flight:
            self._averager.begin_step()
        b = self._bucket_of[index]
        self._ready[b] += 1
        if timeline.on:  # timeline hook
            timeline_marks.gradient(self, b)
        if self._ready[b] > self._sizes[b]:
            raise InvalidArgument(
                "a gradient arrived twice before finish(): call finish() (or optimizer.step() with "
                "optimizer= given) after each backward(), or accumulate inside `with averager.no_sync():`"
            )
        while self._next < len(self._sizes) and self._ready[self._next] == self._sizes[self._next]:
            self._start(self._next)

    def _start(self, b: int) -> None:
        try:
            # on failure the other ranks raise MismatchError for this bucket and the rest
            self._averager.start_bucket(b)
        except MpigpuError:
            self._reset()
            raise
        self._next = b + 1

    def _reset(self) -> None:
        self._ready = [0] * len(self._sizes)
        self._next = 0

    def _before_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if timeline.on:  # timeline hook
            self._tl_step_began = timeline.now()
        self.finish()

    def _after_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The optimizer's step ended (a hook registered only with the timeline on)."""
        if self._tl_step_began:
            averager = self._averager
            timeline.span("step", "optimizer step", self._tl_step_began, timeline.now(),
                          step=averager._tl_step, group=averager._tl_group)  # fmt: skip
            self._tl_step_began = 0

    def finish(self) -> None:
        """Start the buckets still waiting (parameters without gradients count as zeros), wait for
        all, and leave every ``p.grad`` averaged. Does nothing when no step is in flight."""
        averager = self._averager
        if not averager.step_in_flight:
            return
        if timeline.on:  # timeline hook
            timeline_marks.backward_finished(self)
        try:
            while self._next < len(self._sizes):
                self._start(self._next)
            averager.finish()
        except BaseException:
            if self._observed is not None:
                self._observed = []  # observe the next step instead
            raise
        finally:
            self._reset()
        if self._observed is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        """Collective, once, after the first averaged step: bucket the parameters in the order rank 0
        saw their gradients arrive (those that got none last, in the current order), as DDP does. The
        gradients stay where they are (views of the old buckets) and are packed into the new ones at
        the next step, whose buckets they then become."""
        observed, self._observed = self._observed or [], None
        from mpigpu.runtime.context import Context

        ctx = Context.get(self._comm)
        ctx.enter("BackwardAverager")
        try:
            ctx.wait_async()
            agreed = ctx.comm.bcast(observed, root=0)  # ranks may see different orders: rank 0's is used
        finally:
            ctx.leave()
        first = dict.fromkeys(agreed)  # in arrival order; a gradient that arrived twice counts where it came first
        order = [*first, *(i for i in self._order if i not in first)]
        if order == self._order:
            return
        rebuilt = self._new_averager(order)
        rebuilt._tl_group, rebuilt._tl_step = self._averager._tl_group, self._averager._tl_step  # timeline: one series
        old, self._averager, self._order = self._averager, rebuilt, order
        old.close()
        self._index_buckets()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside averages the sum."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def close(self) -> None:
        """Finish a step in flight, remove the hooks and free the buckets' GPU events (idempotent)."""
        self._observed = None  # no rebuild on the way out
        self.finish()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._averager.close()
        comm, self._comm = self._comm, None
        if comm is not None:
            from mpigpu.core._mpi import MPI

            if not MPI().Is_finalized():
                comm.Free()  # closes its context (collective, like close())


def _private_comm(comm: Any) -> Any:
    """A duplicate of ``comm`` (collective) whose calls may come from any thread: the hooks run on
    autograd's device thread, ``finish()`` on the caller's, and the buckets' strict order (not the
    thread) is what makes every rank issue the same calls in the same order."""
    from mpigpu.runtime.context import ANY_THREAD, Context

    base = Context.get(comm)
    base.enter("BackwardAverager")  # made by the thread that owns ``comm``, in its order of calls
    try:
        base.wait_async()
        private = base.comm.Dup()
    finally:
        base.leave()
    Context.get(private).owner = ANY_THREAD
    return private
