"""The `[grpo]` section, at its import path from before the trainer split into learner/ and
recipes/.

A re-export for one step, while configuration loading changes on another branch: the classes
live in `services.trainer.recipes.grpo`; import them from there.
"""

from .recipes.grpo import GrpoJobConfig, TaskJobConfig  # noqa: F401
