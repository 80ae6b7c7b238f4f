"""Installs the torch_npu STAND-IN (CPU tensors, not Ascend) for tests and their subprocesses.

The stand-in itself is the package ``root/torch_npu``: with ``root`` on the import path,
autoprec's own probe (``npu_available``: find the spec, import it, ask ``torch.npu``) finds
it and imports it as it would import torch_npu. In this process ``install()`` puts ``root``
on ``sys.path``; a subprocess gets it through PYTHONPATH (``subprocess_env``). README.md here
says what the stand-in proves and what it cannot.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent / "root"  # holds the importable ``torch_npu``
REPO = Path(__file__).resolve().parents[2]  # this checkout, so subprocesses run its code


def install() -> ModuleType:
    """Import the stand-in as ``torch_npu`` (which registers ``torch.npu``) and return it,
    reset to a fresh machine."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module("torch_npu")
    module.STANDIN.reset()
    return module


def uninstall() -> None:
    """Undo ``install``: torch's patches, ``torch.npu``, the modules and the path entry."""
    module = sys.modules.get("torch_npu")
    if module is not None:
        module.detach()
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]
    while str(ROOT) in sys.path:
        sys.path.remove(str(ROOT))


def subprocess_env(**settings: str) -> dict[str, str]:
    """This environment plus what a child Python process needs to run this checkout's
    autoprec with the stand-in as torch_npu; ``settings`` adds variables such as
    ``NPU_STANDIN_DEVICES="2"`` or ``NPU_STANDIN_SOC="Ascend910A"``."""
    path = [str(REPO), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **settings}
