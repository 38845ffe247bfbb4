"""DDP over mpigpu: a PyTorch DDP script whose only change is the backend, checked against DDP over gloo.

    mpiexec -n 2 python samples/ddp_mpigpu.py [--device cpu|cuda] [--static-graph] [--fp16-hook]

``import mpigpu.torch`` registers the backend "mpigpu"; ``dist.init_process_group("mpigpu")`` then
takes rank, world size and the rendezvous from MPI (no MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE).
The script trains an MLP with DDP over the default group, trains it again from the same start over a
gloo group of the same ranks (NCCL on GPUs of their own), and prints PASS when the parameters agree (the same bits
on CPU at 2 ranks, within float rounding otherwise), are one model on every rank, and the loss fell.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import mpigpu
import mpigpu.torch  # registers the backend "mpigpu"


def train(group: Any, device: torch.device, args: argparse.Namespace) -> tuple[list[torch.Tensor], float, float]:
    """``args.steps`` SGD steps of DDP over ``group``: (parameters, first loss, last loss)."""
    torch.manual_seed(100 + dist.get_rank())  # a different start per rank: DDP broadcasts rank 0's
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    ids = [device.index] if device.type == "cuda" else None
    model = DDP(net, device_ids=ids, process_group=group, static_graph=args.static_graph)
    if args.fp16_hook:
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7)
    x_all = torch.randn(64 * dist.get_world_size(), 32, generator=g)
    y_all = x_all[:, :4].sum(1, keepdim=True)
    x, y = (t[dist.get_rank() :: dist.get_world_size()].to(device) for t in (x_all, y_all))  # this rank's shard
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses[0], losses[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--static-graph", action="store_true")
    parser.add_argument("--fp16-hook", action="store_true", help="DDP's fp16_compress_hook")
    args = parser.parse_args(argv)
    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"

    dist.init_process_group("mpigpu")  # the one line: rank, size and store from MPI
    device = torch.device("cpu")
    if use_cuda:
        gpu = mpigpu.select_device()  # the GPU mpigpu binds this rank to (node-local rank modulo GPUs)
        torch.cuda.set_device(gpu.index)
        device = torch.device("cuda", gpu.index)
    shared = os.environ.get("MPIGPU_ALLOW_SHARED_GPU") == "1"  # ranks sharing a GPU: NCCL refuses them
    reference = dist.new_group(backend="nccl" if use_cuda and not shared else "gloo")
    ours, first, last = train(dist.group.WORLD, device, args)
    theirs, _, _ = train(reference, device, args)

    rank, size = dist.get_rank(), dist.get_world_size()
    bitwise = device.type == "cpu" and size <= 2 and not args.fp16_hook
    if bitwise:
        same = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    else:
        tol = {"rtol": 1e-3, "atol": 1e-4} if args.fp16_hook else {"rtol": 1e-5, "atol": 1e-6}
        same = all(torch.allclose(a, b, **tol) for a, b in zip(ours, theirs, strict=True))
    flat = torch.cat([p.reshape(-1) for p in ours])
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    one_model = all(torch.equal(e, everyone[0]) for e in everyone)
    verdict = torch.tensor([int(same and one_model and last < first)], device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    if rank == 0:
        how = "the same bits" if bitwise else "within float rounding"
        print(f"DDP over mpigpu vs DDP over {dist.get_backend(reference)} ({how}): {'PASS' if same else 'FAIL'}")
        print(f"parameters identical on every rank: {one_model}; loss {first:.4f} -> {last:.4f}")
        print(f"# {'PASS' if verdict.item() else 'FAIL'} ({size} ranks, {device.type})")
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


if __name__ == "__main__":
    sys.exit(main())
