"""A data-parallel SGD loop written with CuPy alone; mpigpu averages the gradients.

    mpiexec -n 4 python samples/cupy_sgd.py [--steps 50]

Each rank fits the same linear model y = x @ w + b to its own shard of a synthetic data set. The
gradients are computed straight into the buffer of an mpigpu.Averager (``bucket_views()``), so
averaging them across ranks is one fused allreduce and no copy. Without a GPU the same code runs on
NumPy (and the sample says so).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import mpigpu
from mpigpu import Averager


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="SGD steps (default 50)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank (default 64)")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto", help="default: GPU if present")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()

    # 1. CuPy on this rank's GPU, or NumPy where there is none: the code below is the same.
    gpu = mpigpu.select_device() if args.device != "cpu" else None
    if args.device == "gpu" and gpu is None:
        raise SystemExit("--device gpu: no GPU is visible")
    if gpu is not None:
        import cupy as xp

        xp.cuda.Device(gpu.index).use()
    else:
        xp = np
    if rank == 0:
        print(f"# {nranks} ranks on {'CuPy, ' + gpu.name if gpu else 'NumPy (no GPU here)'}")

    # 2. This rank's shard of y = x @ w_true + 0.5 + noise (every rank draws the same global set).
    rng = np.random.default_rng(7)
    x_all = rng.standard_normal((args.batch * nranks, 16)).astype(np.float32)
    w_true = rng.standard_normal((16, 4)).astype(np.float32)
    y_all = x_all @ w_true + 0.5 + 0.01 * rng.standard_normal((args.batch * nranks, 4)).astype(np.float32)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    x, y = xp.asarray(x_all[rows]), xp.asarray(y_all[rows])

    # 3. Parameters, and their gradients living in the Averager's bucket.
    w = xp.zeros((16, 4), dtype=xp.float32)
    b = xp.zeros(4, dtype=xp.float32)
    averager = Averager([xp.empty_like(w), xp.empty_like(b)])
    grad_w, grad_b = averager.bucket_views()

    losses = []
    for _ in range(args.steps):
        err = x @ w + b - y  # forward: residuals of the mean squared error
        losses.append(float((err * err).mean()))
        xp.matmul(x.T, err, out=grad_w)  # backward, written into the bucket
        grad_w *= 2.0 / err.size
        grad_b[...] = err.sum(axis=0) * (2.0 / err.size)
        averager()  # average the gradients across ranks: one allreduce, in place
        w -= args.lr * grad_w
        b -= args.lr * grad_b

    # 4. Check: every rank holds the same parameters, and the loss went down.
    params = np.concatenate([np.asarray(w.get() if gpu else w).ravel(), np.asarray(b.get() if gpu else b)])
    identical = all(comm.allgather(np.array_equal(params, comm.bcast(params, root=0))))
    mean_loss = mpigpu.allreduce(np.array([losses[0], losses[-1]]))  # over ranks
    ok = identical and mean_loss[1] < 0.1 * mean_loss[0]
    if rank == 0:
        print(f"# loss {mean_loss[0]:.4f} -> {mean_loss[1]:.4f}; parameters identical on every rank: {identical}")
        print("# PASS" if ok else "# FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    mpigpu.install_abort_handler()  # an uncaught error on one rank ends every rank
    sys.exit(main())
