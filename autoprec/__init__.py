"""autoprec: a mixed-precision autotuner.

Search per-layer dtypes (fp32, fp16, bf16, fp8; int8 for serving) and loss scaling with
short real trials (training steps, or the trained model served), record them in MLflow, and
apply the best policy in your own training loop or serving code.

The public names are what a user calls (``dir(autoprec)`` lists exactly ``__all__``);
everything else stays reachable from its module (``autoprec.trials.training.run_trial``,
``autoprec.devices.get_backend``, ...). Names load on first use, so that applying a policy
(``load_policy`` and ``Policy.apply``) imports neither Optuna nor MLflow.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

if _TYPE_CHECKING:
    from autoprec.distributed import apply_fsdp2, register_comm_hook, shard
    from autoprec.errors import (
        AutoprecError,
        DeviceError,
        ExportError,
        ExportWarning,
        GuardError,
        LoopError,
        PolicyError,
        SearchInterrupted,
        SpaceError,
        StoreError,
        SummaryError,
        TaskError,
        WriteError,
    )
    from autoprec.guard import Guard
    from autoprec.numerics.telemetry import GradientMonitor
    from autoprec.policy import Policy, Rule, load_policy
    from autoprec.precision.hooks import Precision
    from autoprec.precision.loss_scale import LossScale
    from autoprec.profile.sensitivity import Profile, profile_task
    from autoprec.serving import load_served_model
    from autoprec.study import Callbacks, SearchConfig, SearchResult, search
    from autoprec.tasks import Task
    from autoprec.tracking import load_best_policy

_ERRORS = (
    "AutoprecError",
    "DeviceError",
    "ExportError",
    "ExportWarning",
    "GuardError",
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
    "Callbacks": "autoprec.study",
    "GradientMonitor": "autoprec.numerics.telemetry",
    "Guard": "autoprec.guard",
    "LossScale": "autoprec.precision.loss_scale",
    "Policy": "autoprec.policy",
    "Precision": "autoprec.precision.hooks",
    "Profile": "autoprec.profile.sensitivity",
    "Rule": "autoprec.policy",
    "SearchConfig": "autoprec.study",
    "SearchResult": "autoprec.study",
    "Task": "autoprec.tasks",
    "apply_fsdp2": "autoprec.distributed",
    "load_best_policy": "autoprec.tracking",
    "load_served_model": "autoprec.serving",
    # its earlier name, still importable
    "load_inference_model": "autoprec.serving",
    "load_policy": "autoprec.policy",
    "profile_task": "autoprec.profile.sensitivity",
    "register_comm_hook": "autoprec.distributed",
    "search": "autoprec.study",
    "shard": "autoprec.distributed",
}
__all__ = [
    "AutoprecError",
    "Callbacks",
    "DeviceError",
    "ExportError",
    "ExportWarning",
    "GradientMonitor",
    "Guard",
    "GuardError",
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
    "load_policy",
    "load_served_model",
    "profile_task",
    "register_comm_hook",
    "search",
    "shard",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> _Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'autoprec' has no attribute {name!r}")
    module = _importlib.import_module(_WHERE[name])
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
