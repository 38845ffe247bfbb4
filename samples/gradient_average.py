"""Average a gradient across MPI ranks with mpigpu: the seed sample, rewritten.

    mpiexec -n 4 python samples/gradient_average.py [--size 1M] [--iters 20]

Each rank binds its GPU, computes a "gradient" grad[i] = rank + 0.001*i with its own CUDA kernel
(compiled at run time by NVRTC through cuda.core), averages it across the ranks with
mpigpu.allreduce, checks every element against (N-1)/2 + 0.001*i, and times the call with CUDA
events. On a machine with no GPU the same steps run on NumPy, and the sample says so.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import mpigpu
from mpigpu.core.config import parse_count

# The per-rank gradient. __fadd_rn/__fmul_rn round each step (no fused multiply-add), so the host
# can reproduce every value exactly.
KERNEL = r"""
extern "C" __global__ void gradient(float* grad, long long n, int rank) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        grad[i] = __fadd_rn((float)rank, __fmul_rn(0.001f, __ll2float_rn(i)));
    }
}
"""


def gpu_gradient(n: int, rank: int, gpu: mpigpu.GpuInfo):
    """The gradient on the GPU: a CuPy array filled by our own kernel on a cuda.core stream."""
    import cupy
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch

    device = Device(gpu.index)
    device.set_current()
    stream = device.create_stream()
    arch = f"sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]}"
    program = Program(KERNEL, code_type="c++", options=ProgramOptions(arch=arch, std="c++17"))
    kernel = program.compile("cubin").get_kernel("gradient")
    grad = cupy.empty(n, dtype=np.float32)
    blocks = min(65535, (n + 255) // 256)
    # Kernel scalars are passed as typed NumPy values (a Python int would be taken for a pointer).
    launch(stream, LaunchConfig(grid=blocks, block=256), kernel, int(grad.data.ptr), np.int64(n), np.int32(rank))
    return grad, stream


def expected(n: int, nranks: int) -> np.ndarray:
    """What every element must be after averaging, from the same float32 steps as the kernel."""
    i = np.arange(n, dtype=np.float32)
    ranks = [np.float32(r) + np.float32(0.001) * i for r in range(nranks)]
    return np.mean(np.stack(ranks).astype(np.float64), axis=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_count, default=1 << 20, help="elements (default 1M)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls (default 20)")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto", help="default: GPU if present")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, nranks, n = comm.Get_rank(), comm.Get_size(), args.size

    # 1. Bind this rank to its GPU (node-local rank modulo the visible GPUs); None without a GPU.
    gpu = mpigpu.select_device() if args.device != "cpu" else None
    if args.device == "gpu" and gpu is None:
        raise SystemExit("--device gpu: no GPU is visible")

    # 2. Compute this rank's gradient.
    if gpu is not None:
        grad, stream = gpu_gradient(n, rank, gpu)
        where = gpu.describe()
    else:
        grad, stream = np.float32(rank) + np.float32(0.001) * np.arange(n, dtype=np.float32), None
        where = "host memory (NumPy): no GPU here"
    print(f"rank {rank}/{nranks}: {n} float32 elements on {where}")

    # 3. Average across ranks, in place, ordered on our stream. mpigpu picks the backend.
    mpigpu.allreduce(grad, "avg", stream=stream)
    choice = mpigpu.explain(grad)

    # 4. Verify every element against the closed form (N-1)/2 + 0.001*i.
    if gpu is not None:
        stream.sync()  # our stream is non-blocking: wait for it before copying the result to the host
        result = grad.get()
    else:
        result = grad
    wrong = int(np.count_nonzero(~np.isclose(result, expected(n, nranks), rtol=1e-6, atol=1e-6)))
    wrong = comm.allreduce(wrong)

    # 5. Time the call: CUDA events on the stream (GPU), the host clock otherwise.
    comm.Barrier()
    if gpu is not None:
        from cuda.core import EventOptions

        timing = EventOptions(timing_enabled=True)
        start = stream.record(options=timing)
        for _ in range(args.iters):
            mpigpu.allreduce(grad, "avg", stream=stream)
        end = stream.record(options=timing)
        end.sync()
        per_call_us = (end - start) * 1e3 / args.iters  # event difference is in milliseconds
    else:
        t0 = time.perf_counter()
        for _ in range(args.iters):
            mpigpu.allreduce(grad, "avg")
        per_call_us = (time.perf_counter() - t0) * 1e6 / args.iters
    slowest = max(comm.allgather(per_call_us))
    if rank == 0:
        print(f"backend {choice.backend} ({choice.reason})")
        print(f"{n * 4} bytes: {slowest:.1f} us per allreduce (slowest rank), {wrong} wrong elements")
        print("PASS" if wrong == 0 else "FAIL")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    mpigpu.install_abort_handler()  # an uncaught error on one rank ends every rank
    sys.exit(main())
