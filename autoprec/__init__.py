"""autoprec: a mixed-precision autotuner.

Search per-layer dtypes (fp32, fp16, bf16) and loss scaling with short real training
trials, record them in MLflow, and apply the best policy in your own training loop.

The public names are what a user calls; everything else stays reachable from its module
(``autoprec.trial.run_trial``, ``autoprec.devices.get_backend``, ...). Names load on
first use, so that applying a policy (``load_policy`` and ``Policy.apply``) imports
neither Optuna nor MLflow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autoprec.errors import AutoprecError
    from autoprec.inference import load_inference_model
    from autoprec.policy import Policy, Rule, load_policy
    from autoprec.precision import Precision
    from autoprec.profile import Profile, profile_task
    from autoprec.scaling import LossScale
    from autoprec.search import SearchConfig, SearchInterrupted, search
    from autoprec.tasks import Task
    from autoprec.telemetry import GradientMonitor
    from autoprec.tracking import load_best_policy

_WHERE = {
    "AutoprecError": "autoprec.errors",
    "GradientMonitor": "autoprec.telemetry",
    "LossScale": "autoprec.scaling",
    "Policy": "autoprec.policy",
    "Precision": "autoprec.precision",
    "Profile": "autoprec.profile",
    "Rule": "autoprec.policy",
    "SearchConfig": "autoprec.search",
    "SearchInterrupted": "autoprec.search",
    "Task": "autoprec.tasks",
    "load_best_policy": "autoprec.tracking",
    "load_inference_model": "autoprec.inference",
    "load_policy": "autoprec.policy",
    "profile_task": "autoprec.profile",
    "search": "autoprec.search",
}
__all__ = [
    "AutoprecError",
    "GradientMonitor",
    "LossScale",
    "Policy",
    "Precision",
    "Profile",
    "Rule",
    "SearchConfig",
    "SearchInterrupted",
    "Task",
    "load_best_policy",
    "load_inference_model",
    "load_policy",
    "profile_task",
    "search",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'autoprec' has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name])
    # A name that is its own package (``search``) is the package, which is callable, so
    # that ``autoprec.search.Callbacks`` resolves as well as ``autoprec.search(...)``.
    value = module if module.__name__ == f"autoprec.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
