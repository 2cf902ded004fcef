"""Long-context multi-step arithmetic tasks on which KV-cache eviction is measured."""

from kvpop_eval.tasks.generator import SPLITS, Fact, Question, Task, TaskConfig, generate_split, generate_task
from kvpop_eval.tasks.scoring import accuracy, exact_match, extract_final_answer

__all__ = [
    "SPLITS",
    "Fact",
    "Question",
    "Task",
    "TaskConfig",
    "accuracy",
    "exact_match",
    "extract_final_answer",
    "generate_split",
    "generate_task",
]
