"""The `[ppo]` section, at its import path from before the trainer split into learner/ and
recipes/.

A re-export for one step, while configuration loading changes on another branch: the class
lives in `services.trainer.recipes.ppo`; import it from there.
"""

from .recipes.ppo import PpoJobConfig  # noqa: F401
