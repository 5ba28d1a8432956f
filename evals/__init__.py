"""One module per benchmark; importing the package registers every task."""

from evals.base import Headline, Task, TaskResult, available_tasks, build_task, register_task

__all__ = ["Headline", "Task", "TaskResult", "available_tasks", "build_task", "register_task"]
