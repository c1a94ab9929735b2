"""Whether our Triton kernels on a device let the next kernel in the stream launch before they
finish (`griddepcontrol.launch_dependents`, compute capability 9.0+). Only a kernel launched to
overlap its predecessor uses that (the few-row GEMVs of bench/variants/pdl); every other kernel
still waits for the whole grid, so the signal changes nothing for them. The PTX instruction does
not exist before sm90, hence the check; `ALBATROSS_PDL=0` turns it off, as it does the launches."""

from __future__ import annotations

import functools
import os

import torch


def launch_dependents(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("ALBATROSS_PDL") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9
