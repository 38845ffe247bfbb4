"""``python -m mpigpu.cleanup``: remove the files a killed MPICH job left in /dev/shm, and nothing of a
live job's.

MPICH keeps one file per job and node in /dev/shm and removes it when the job ends normally or through
mpigpu's abort; a rank killed outright (``kill -9``, the OOM killer, a node's watchdog) leaves it, and
each one holds 1-4 MiB of memory until removed. This removes only this user's MPICH files that no
process maps or holds open and that are older than ``--min-age`` seconds (a job still starting may not
have mapped its file yet); it never follows a symlink. Processes whose memory maps cannot be read
(another user's, a container's init) are named and not counted: an MPI rank is an ordinary process
its own user can read. Run it on each node (``mpiexec -n <nodes> -ppn 1
python -m mpigpu.cleanup`` reaches every node of an allocation). Starts no MPI.

Exit status: 0 (also when nothing was found), 2 for invalid options.
"""

from __future__ import annotations

import sys

from mpigpu.cli import Parser, prog
from mpigpu.job.mpich_shm import leftovers, remove

__all__ = ["main"]


def build_parser() -> Parser:
    parser = Parser(prog=prog("mpigpu.cleanup"), description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    parser.add_argument("--min-age", type=float, default=60.0, metavar="S", help="skip files younger (default 60)")
    parser.add_argument("--dir", default="/dev/shm", help="where MPICH keeps its files (default /dev/shm)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    found, unread = leftovers(args.dir, args.min_age)
    done = found if args.dry_run else remove(args.dir, found)
    verb = "would remove" if args.dry_run else "removed"
    where = args.dir.rstrip("/")
    for leftover in done:
        print(f"{verb} {where}/{leftover.name} ({leftover.nbytes >> 10} KiB, {leftover.age_s:.0f} s old)")
    if unread:
        print(f"# could not read the memory maps of process{'es' if len(unread) > 1 else ''} {unread} (not counted)")
    print(f"# {verb} {len(done)} file{'s' if len(done) != 1 else ''} of jobs that are gone from {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
