"""The names the ``autoprec`` command offers before it runs anything: built-in tasks, samplers
and the default stores (the formats' names and methods need no mirror: `autoprec.formats`
imports no torch).

They live here, away from the registries that define them (which import torch, MLflow and
Optuna), so that ``autoprec --version`` and every ``--help`` answer without importing any of
those. tests/test_cli_help.py checks each name list against its registry.
"""

from __future__ import annotations

# autoprec.tasks.BUILTIN_TASKS, in its order, and autoprec.tasks.DEFAULT_TASK
BUILTIN_TASK_NAMES = (
    "digits-mlp",
    "digits-cnn",
    "digits-resnet",
    "digits-overflow",
    "digits-underflow",
    "fp8-outliers",
    "rare-features",
    "late-overflow",
    "tiny-gpt2",
    "tiny-bert",
    "tiny-llama",
    "tiny-t5",
)
DEFAULT_TASK = "digits-mlp"
# autoprec.study.config's and autoprec.tracking's
DEFAULT_STORAGE = "sqlite:///runs/optuna.db"
DEFAULT_TRACKING_URI = "sqlite:///runs/mlflow.db"
SAMPLERS = ("guided", "tpe", "nsga2", "random")
HEARTBEAT_INTERVAL_S = 10
