"""Run Triton kernels on CPU tensors through Triton's interpreter when there is no GPU.

Import this before triton. Also works around the interpreter's ``__index__`` on scalar
tensors (``int()`` of a 1-element array, an error with numpy 2), which loop bounds need.
"""
from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401
    import triton.runtime.interpreter as _interp
except ImportError:  # pragma: no cover - the tests importorskip triton themselves
    _interp = None

if _interp is not None and hasattr(_interp, "_patch_lang_tensor"):
    _orig_patch = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor
