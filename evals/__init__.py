"""One module per benchmark; importing the package registers every task."""

from evals.base import Task, TaskResult, available_tasks, build_task, register_task

__all__ = ["Task", "TaskResult", "available_tasks", "build_task", "register_task"]
