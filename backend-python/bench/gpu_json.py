"""The JSON file of a GPU benchmark: what ran where (device, torch, Python, date), then its figures."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch


def write_gpu_json(path: Path, **figures: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        **figures,
    }
    path.write_text(json.dumps(payload, indent=2))
