"""Tasks: the contract, loading by name, and the built-in digits tasks."""

from autoprec.tasks.base import Task, check_task, check_task_data
from autoprec.tasks.builtin import BUILTIN_TASKS, DEFAULT_TASK
from autoprec.tasks.loading import load_task

__all__ = ["BUILTIN_TASKS", "DEFAULT_TASK", "Task", "check_task", "check_task_data", "load_task"]
