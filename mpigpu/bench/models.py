"""What ``bench_training`` trains: the models, built locally from a seed (no downloaded weights), one
batch of synthetic data per rank and the loss; and ``torch.distributed`` started from MPI, for the
DistributedDataParallel anchor.

torchvision (ResNet-50) and transformers (GPT-2) are optional: ``missing`` says in one line what a
model needs when it cannot be built here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["MODELS", "TrainingModel", "build", "init_torch_distributed", "missing"]

MODELS = ("mlp", "resnet50", "gpt2")
_NEEDS = {"mlp": ("torch",), "resnet50": ("torch", "torchvision"), "gpt2": ("torch", "transformers")}


def missing(name: str) -> str | None:
    """None if ``name`` can be built here, else one line saying which package to install."""
    for package in _NEEDS[name]:
        try:
            importlib.import_module(package)
        except ImportError as exc:
            return f"--model {name} needs {package}, which cannot be imported here ({exc}): pip install {package}"
    return None


@dataclass
class TrainingModel:
    """A model with its initial parameters, this rank's batch, and the loss of a forward pass."""

    name: str
    description: str
    module: Any  # torch.nn.Module on its device; copied (copy.deepcopy) for every row of the benchmark
    inputs: tuple[Any, ...]
    loss: Callable[[Any, tuple[Any, ...]], Any]  # (module, inputs) -> scalar loss tensor
    channels_last: bool = False


def _mlp(args: argparse.Namespace, gen: Any, device: Any) -> TrainingModel:
    import torch

    layers: list[Any] = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    module = torch.nn.Sequential(*layers)
    batch = args.batch or (1024 if device.type == "cuda" else 32)
    x = torch.randn(batch, args.width, generator=gen)
    y = torch.randn(batch, args.width, generator=gen)

    def loss(model: Any, inputs: tuple[Any, ...]) -> Any:
        return torch.nn.functional.mse_loss(model(inputs[0]), inputs[1])

    text = f"MLP {args.depth} x Linear({args.width}, {args.width}) + ReLU, batch {batch} per rank"
    return TrainingModel("mlp", text, module, (x, y), loss)


def _resnet50(args: argparse.Namespace, gen: Any, device: Any) -> TrainingModel:
    import torch
    import torchvision

    module = torchvision.models.resnet50(weights=None)
    batch, size = args.batch or 64, args.image_size
    x = torch.randn(batch, 3, size, size, generator=gen)
    y = torch.randint(0, 1000, (batch,), generator=gen)

    def loss(model: Any, inputs: tuple[Any, ...]) -> Any:
        return torch.nn.functional.cross_entropy(model(inputs[0]), inputs[1])

    text = f"ResNet-50 (torchvision {torchvision.__version__}, channels_last), {batch} x 3 x {size} x {size} per rank"
    return TrainingModel("resnet50", text, module, (x, y), loss, channels_last=True)


def _gpt2(args: argparse.Namespace, gen: Any, device: Any) -> TrainingModel:
    import torch
    import transformers

    config = transformers.GPT2Config()  # GPT-2 small: 124 M parameters, dropout 0.1 (seeded per row)
    if getattr(args, "deterministic", False):
        # attention as plain matrix products (the fused attention kernels' backward is not deterministic);
        # torch's math attention, which training._deterministic leaves as the only one, is the fallback
        with contextlib.suppress(AttributeError, ValueError):
            config._attn_implementation = "eager"
    module = transformers.GPT2LMHeadModel(config)
    batch, tokens = args.batch or 8, args.seq_len
    if tokens > config.n_positions:
        raise ValueError(f"--seq-len {tokens}: GPT-2 takes at most {config.n_positions} tokens")
    ids = torch.randint(0, config.vocab_size, (batch, tokens), generator=gen)

    def loss(model: Any, inputs: tuple[Any, ...]) -> Any:
        return model(input_ids=inputs[0], labels=inputs[0]).loss

    text = f"GPT-2 124M (transformers {transformers.__version__}, GPT2Config()), {batch} x {tokens} tokens per rank"
    return TrainingModel("gpt2", text, module, (ids,), loss)


_BUILDERS = {"mlp": _mlp, "resnet50": _resnet50, "gpt2": _gpt2}


def build(name: str, args: argparse.Namespace, device: Any, rank: int) -> TrainingModel:
    """The model ``name`` with the same initial parameters on every rank (built on the host from
    ``args.seed``), and this rank's own batch (its own seed), both moved to ``device``."""
    import torch

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed * 1000 + 1 + rank)
    made = _BUILDERS[name](args, gen, device)
    made.module.to(device)
    if made.channels_last:
        made.module.to(memory_format=torch.channels_last)
    moved = []
    for t in made.inputs:
        t = t.to(device)
        moved.append(t.contiguous(memory_format=torch.channels_last) if made.channels_last and t.dim() == 4 else t)
    made.inputs = tuple(moved)
    return made


def init_torch_distributed(comm: Any, backend: str, timeout_s: float = 120.0) -> None:
    """Start ``torch.distributed`` with the ranks and size of the MPI communicator ``comm``.

    Rank 0 opens a TCPStore on a port the system picks (no race for a free port) and broadcasts its
    address and port over MPI; nothing comes from launcher variables, so this works alike under
    MPICH's mpiexec, Open MPI and Intel MPI. The address is 127.0.0.1 when every rank runs on one
    host, else ``MASTER_ADDR`` if set on rank 0, else rank 0's host name."""
    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    one_host = len(set(comm.allgather(socket.gethostname()))) == 1
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    where: tuple[str, int] | None = None
    if rank == 0:
        host = "127.0.0.1" if one_host else os.environ.get("MASTER_ADDR") or socket.gethostname()
        store = dist.TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        where = (host, int(store.port))
    host, port = comm.bcast(where, root=0)
    if rank != 0:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
