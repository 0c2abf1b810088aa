"""The `[grpo]` section with its asynchronous fields, at its import path from before the
trainer split into learner/ and recipes/.

A re-export for one step, while configuration loading changes on another branch: the class
lives in `services.trainer.recipes.grpo_async`; import it from there.
"""

from .recipes.grpo_async import AsyncGrpoJobConfig  # noqa: F401
