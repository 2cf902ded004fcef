"""Long-context multi-step arithmetic tasks: the reference model is trained on them (kvpop_train) and KV-cache
eviction is measured on them (kvpop_eval). Neither imports the other for them; both import this package.
"""

from kvpop_tasks.generator import SPLITS, Fact, Question, Task, TaskConfig, generate_split, generate_task
from kvpop_tasks.scoring import accuracy, exact_match, extract_final_answer

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
