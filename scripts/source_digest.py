"""Which code a measurement ran: a digest of mpigpu's source files, the same for a working tree and for
the commit it was made from, so a result made where no git history travels (the GPU machine's copy of
the tree) still names its code.

    python scripts/source_digest.py                  # the working tree's digest
    python scripts/source_digest.py --rev HEAD~3     # a commit's
    python scripts/source_digest.py --find 3f2a9c01  # the commits, newest first, whose digest this is

The digest is SHA-256 over mpigpu/'s source files (.py, .c, .h, .cu, .cpp) in path order, each as its
path, its length and its bytes; its first 12 hex digits are printed. Results files record it
(scripts/cpu_nodes.py: "source"; scripts/gpu-check.sh: its summary's header).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "mpigpu"
SUFFIXES = (".py", ".c", ".h", ".cu", ".cpp")
LENGTH = 12  # hex digits shown: enough to tell this project's commits apart


def _digest(files: Iterable[tuple[str, bytes]]) -> str:
    sha = hashlib.sha256()
    for path, data in sorted(files):
        sha.update(f"{path}\0{len(data)}\0".encode())
        sha.update(data)
    return sha.hexdigest()[:LENGTH]


def tree_digest(root: Path = ROOT) -> str:
    """The digest of the source files under ``root``/mpigpu as they are on disk (links not followed)."""
    base = root / PACKAGE
    files = []
    for path in base.rglob("*"):
        if path.suffix in SUFFIXES and path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
            files.append((path.relative_to(root).as_posix(), path.read_bytes()))
    return _digest(files)


def _git(root: Path, *args: str, given: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(root), *args], input=given, capture_output=True, check=True).stdout


def commit_digest(rev: str, root: Path = ROOT) -> str:
    """The digest of the source files under mpigpu/ in commit ``rev`` of the repository at ``root``
    (their blobs read by one ``git cat-file --batch``)."""
    listing = _git(root, "ls-tree", "-r", rev, "--", PACKAGE).decode().splitlines()
    entries = [line.split("\t", 1) for line in listing]  # "<mode> blob <id>", path
    wanted = [(meta.split()[2], path) for meta, path in entries if Path(path).suffix in SUFFIXES]
    out = _git(root, "cat-file", "--batch", given="".join(f"{blob}\n" for blob, _ in wanted).encode())
    files, at = [], 0
    for _, path in wanted:  # each: "<id> blob <size>\n" <size bytes> "\n"
        end = out.index(b"\n", at)
        size = int(out[at:end].split()[2])
        files.append((path, out[end + 1 : end + 1 + size]))
        at = end + 2 + size
    return _digest(files)


def find(digest: str, root: Path = ROOT, most: int = 200) -> list[str]:
    """The commits (short hashes, newest first) among the last ``most`` whose digest starts with ``digest``."""
    revs = _git(root, "log", f"-{most}", "--format=%h").decode().split()
    return [rev for rev in revs if commit_digest(rev, root).startswith(digest.lower())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"{sys.executable} scripts/source_digest.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--rev", help="a commit's digest instead of the working tree's")
    which.add_argument("--find", metavar="DIGEST", help="the commits whose digest this is (or starts with)")
    parser.add_argument("--most", type=int, default=200, help="with --find: how many recent commits to search")
    args = parser.parse_args(argv)
    try:
        if args.find:
            found = find(args.find, most=args.most)
            print("\n".join(found) if found else f"no commit among the last {args.most} has digest {args.find}")
            return 0 if found else 1
        print(commit_digest(args.rev) if args.rev else tree_digest())
    except subprocess.CalledProcessError as exc:
        print(f"git failed: {exc.stderr.decode().strip()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
