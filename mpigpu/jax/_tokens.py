"""Pass mpigpu's runtime token from one compiled program to the next without the host waiting.

JAX threads an ordered effect's token between successive programs (its "runtime tokens"). Before each
program it re-places the previous program's output token on the program's devices
(``RuntimeTokenSet.get_token_input``: ``device_put`` of a ``core.Token``), and that placement first
waits for the token (``_token_shard_arg`` calls ``block_until_ready``): the host stops until the
previous program has finished, every step. For a training step that is host dispatch + device
time in series, never overlapped (read in JAX 0.10.2's dispatch.py and array.py).

For mpigpu's effect on one device the wait orders nothing that the data does not already order:
the previous program's output token, passed as this program's input token unchanged, is a data
dependency the runtime honours on the device (a GPU stream waits for the buffer's event; the CPU
runtime starts the program once its inputs are ready). So, for this effect only, and only when the
token already lives on exactly the program's one device, ``install`` hands the token over as it is.
Any other effect, a token on other devices, or a JAX without this structure keeps JAX's own path.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["install", "jax_host_wait"]

_lock = threading.Lock()
_installed: list[bool] = []
_passing = [True]  # False inside jax_host_wait()


def install(effect: Any) -> bool:
    """Make JAX pass ``effect``'s token between programs on one device without a host wait.
    Idempotent; False (JAX's behaviour kept) where this JAX has no ``RuntimeTokenSet.get_token_input``."""
    with _lock:
        if _installed:
            return _installed[0]
        try:
            from jax._src import core
            from jax._src.dispatch import RuntimeTokenSet

            original = RuntimeTokenSet.get_token_input
        except (ImportError, AttributeError):
            _installed.append(False)
            return False

        @functools.wraps(original)
        def get_token_input(self: Any, eff: Any, devices: Any) -> Any:
            if eff == effect and len(devices) == 1 and _passing[0]:
                token = self.current_tokens.get(eff)
                if isinstance(token, core.Token) and _only_on(token, devices[0]):
                    return token
            return original(self, eff, devices)

        RuntimeTokenSet.get_token_input = get_token_input
        _installed.append(True)
        return True


@contextlib.contextmanager
def jax_host_wait() -> Iterator[None]:
    """JAX's own behaviour (a host wait before every program) inside the block, for measuring what the
    token passing saves (scripts/jax_step_bench.py). Not thread-safe: for benchmarks only."""
    _passing[0] = False
    try:
        yield
    finally:
        _passing[0] = True


def _only_on(token: Any, device: Any) -> bool:
    """True if the token's buffer is a single-device array on ``device``."""
    try:
        return set(token._buf.sharding.device_set) == {device}
    except AttributeError:
        return False
