"""Data-parallel JAX training: one jitted step (loss, grad, average across ranks, update).

    mpiexec -n 4 python samples/jax_step.py [--steps 30]

Each rank takes jax.grad of the loss on its own shard; mpigpu.jax.average_tree averages the gradient
tree across ranks inside the compiled step (the leaves packed into one buffer, one allreduce, an XLA
FFI call on the step's own CUDA stream on GPUs), and the step applies the update. Nothing leaves the
compiled function and the host never waits inside a step. mpigpu.jax.init(), called before JAX starts,
makes each rank's own GPU JAX's default device under any launcher (Open MPI shows every rank every GPU);
JAX is asked not to preallocate most of that GPU's memory. Without a GPU JAX runs on the CPU and the
same code applies.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import mpigpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank (default 64)")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # mpigpu's buffers share the GPU

    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    import mpigpu.jax as mj

    device = mj.init()  # this rank's GPU (else the CPU), now JAX's default device
    if rank == 0:
        print(f"# {nranks} ranks, JAX {jax.__version__} on {device.platform}; one jitted step with the average inside")

    # This rank's shard of y = tanh(x @ w_true) (every rank draws the same global set).
    rng = np.random.default_rng(3)
    x_all = rng.standard_normal((args.batch * nranks, 8)).astype(np.float32)
    y_all = np.tanh(x_all @ rng.standard_normal((8, 2)).astype(np.float32))
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    x, y = jnp.asarray(x_all[rows]), jnp.asarray(y_all[rows])  # on the default device: the rank's
    params = {"w": jnp.zeros((8, 2)), "b": jnp.zeros(2)}

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

    @jax.jit
    def step(p, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        grads = mj.average_tree(grads)  # across ranks, inside the compiled step
        return jax.tree_util.tree_map(lambda q, g: q - args.lr * g, p, grads), loss

    losses = []
    for _ in range(args.steps):
        params, loss = step(params, x, y)
        losses.append(loss)  # left on the device: no host synchronisation inside the loop

    # Check: every rank holds the same parameters, and the loss went down.
    mine = np.asarray(ravel_pytree(params)[0])
    identical = all(comm.allgather(np.array_equal(mine, comm.bcast(mine, root=0))))
    mean_loss = mpigpu.allreduce(np.array([float(losses[0]), float(losses[-1])]))
    ok = identical and mean_loss[1] < 0.5 * mean_loss[0]
    if rank == 0:
        print(f"# loss {mean_loss[0]:.4f} -> {mean_loss[1]:.4f}; parameters identical on every rank: {identical}")
        print("# PASS" if ok else "# FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    mpigpu.install_abort_handler()  # an uncaught error on one rank ends every rank
    sys.exit(main())
