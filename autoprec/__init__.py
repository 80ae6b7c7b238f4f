"""autoprec: a mixed-precision autotuner.

Search per-layer dtypes (fp32, fp16, bf16) and loss scaling with short real training
trials, record them in MLflow, and apply the best policy in your own training loop.
"""

from autoprec.devices import get_backend
from autoprec.errors import AutoprecError
from autoprec.policy import Policy, Rule, load_policy
from autoprec.precision import Precision
from autoprec.profile import Profile, profile_task
from autoprec.scaling import LossScale
from autoprec.search import SearchInterrupted, SearchResult, search
from autoprec.tasks import Task, load_task
from autoprec.telemetry import GradientMonitor
from autoprec.tracking import load_best_policy
from autoprec.trial import Budget, EarlyStopping, TrialResult, run_trial

__all__ = [
    "AutoprecError",
    "Budget",
    "EarlyStopping",
    "GradientMonitor",
    "LossScale",
    "Policy",
    "Precision",
    "Profile",
    "Rule",
    "SearchInterrupted",
    "SearchResult",
    "Task",
    "TrialResult",
    "get_backend",
    "load_best_policy",
    "load_policy",
    "load_task",
    "profile_task",
    "run_trial",
    "search",
]
__version__ = "0.1.0"
