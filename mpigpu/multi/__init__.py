"""Several devices in one process: every (rank, device) pair takes part in a collective.

Two ways to drive them: a thread per device, bound with ``on_device(i)`` for all its calls, or one thread
passing a list with one array per device (``mpigpu.allreduce([t0, t1])``). Either way the call is
averaged over every device of every rank (``avg`` divides by the number of devices in the job).
``mpigpu.calls`` (reduce, persistent) hands such calls to mpigpu.calls.devices, which meets the devices here.
"""

from mpigpu.multi.binding import bound_index, local_devices, on_device

__all__ = ["bound_index", "local_devices", "on_device"]
