"""Set up Triton's CPU interpreter for the scripts that run our Triton kernels under it
(`wkv_chunked_interpreter.py`, `int8_triton_interpreter.py`). Import it before any kernel module:
TRITON_INTERPRET must be set when the kernels are decorated, which is why the tests start those
scripts in child processes with it set."""

from __future__ import annotations

import os

import numpy as np
import triton.runtime.interpreter as interpreter

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

# Triton 3.6's interpreter turns scalars (loop bounds, scalar loads) into ints with int() on a
# one-element array, which NumPy 2 refuses; take the element instead.
_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_with_scalar_index(tensor: object, scope: object) -> None:
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))  # type: ignore[attr-defined]


interpreter._patch_lang_tensor = _patch_with_scalar_index
