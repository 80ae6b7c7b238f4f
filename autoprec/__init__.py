"""autoprec: a mixed-precision autotuner.

Search per-layer dtypes (fp32, fp16, bf16, fp8; int8 for serving) and loss scaling with
short real trials (training steps, or the trained model served), record them in MLflow, and
apply the best policy in your own training loop or serving code.

The public names are what a user calls (``dir(autoprec)`` lists exactly ``__all__``);
everything else stays reachable from its module (``autoprec.trials.training.run_trial``,
``autoprec.devices.get_backend``, ...). Names load on first use, so that applying a policy
(``load_policy`` and ``Policy.apply``) imports neither Optuna nor MLflow.

``autoprec.search`` is the function that runs a search, whatever was imported before:
the package of the same name (``autoprec.search.config``, ...) is bound to
``autoprec.search`` by Python's import system when one of its modules is imported, and
this package declines that binding (`_Package`). The function's attributes are the
package's names (``autoprec.search.Callbacks``, ``autoprec.search.config``).
"""

from __future__ import annotations

import importlib as _importlib
import sys as _sys
import types as _types
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

if _TYPE_CHECKING:
    from autoprec.distributed import apply_fsdp2, shard
    from autoprec.errors import (
        AutoprecError,
        DeviceError,
        ExportError,
        ExportWarning,
        LoopError,
        PolicyError,
        SearchInterrupted,
        SpaceError,
        StoreError,
        SummaryError,
        TaskError,
        WriteError,
    )
    from autoprec.inference import load_inference_model
    from autoprec.policy import Policy, Rule, load_policy
    from autoprec.precision import Precision
    from autoprec.profile import Profile, profile_task
    from autoprec.scaling import LossScale
    from autoprec.search import Callbacks, SearchConfig, SearchResult, search
    from autoprec.tasks import Task
    from autoprec.telemetry import GradientMonitor
    from autoprec.tracking import load_best_policy

_ERRORS = (
    "AutoprecError",
    "DeviceError",
    "ExportError",
    "ExportWarning",
    "LoopError",
    "PolicyError",
    "SearchInterrupted",
    "SpaceError",
    "StoreError",
    "SummaryError",
    "TaskError",
    "WriteError",
)
_WHERE = {
    **dict.fromkeys(_ERRORS, "autoprec.errors"),
    "Callbacks": "autoprec.search",
    "GradientMonitor": "autoprec.telemetry",
    "LossScale": "autoprec.scaling",
    "Policy": "autoprec.policy",
    "Precision": "autoprec.precision",
    "Profile": "autoprec.profile",
    "Rule": "autoprec.policy",
    "SearchConfig": "autoprec.search",
    "SearchResult": "autoprec.search",
    "Task": "autoprec.tasks",
    "apply_fsdp2": "autoprec.distributed",
    "load_best_policy": "autoprec.tracking",
    "load_inference_model": "autoprec.inference",
    "load_policy": "autoprec.policy",
    "profile_task": "autoprec.profile",
    "search": "autoprec.search",
    "shard": "autoprec.distributed",
}
__all__ = [
    "AutoprecError",
    "Callbacks",
    "DeviceError",
    "ExportError",
    "ExportWarning",
    "GradientMonitor",
    "LoopError",
    "LossScale",
    "Policy",
    "PolicyError",
    "Precision",
    "Profile",
    "Rule",
    "SearchConfig",
    "SearchInterrupted",
    "SearchResult",
    "SpaceError",
    "StoreError",
    "SummaryError",
    "Task",
    "TaskError",
    "WriteError",
    "apply_fsdp2",
    "load_best_policy",
    "load_inference_model",
    "load_policy",
    "profile_task",
    "search",
    "shard",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> _Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'autoprec' has no attribute {name!r}")
    module = _importlib.import_module(_WHERE[name])
    value = getattr(module, name)
    if name == "search":
        # The function's attributes are the names of its package, its globals: what reads
        # the package through this name still works (autoprec.search.Callbacks, as the
        # README writes it; autoprec.search.config; import autoprec.search.config as c).
        value.__dict__ = module.__dict__
    globals()[name] = value
    return value


class _Package(_types.ModuleType):
    """This package's module type: it keeps the name ``search`` for the function."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "search" and isinstance(value, _types.ModuleType):
            # ``import autoprec.search.<module>`` binds the subpackage here once it is
            # loaded; the name stays the function, resolved on first use.
            return
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return list(__all__)


_sys.modules[__name__].__class__ = _Package
