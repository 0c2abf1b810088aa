"""The recipes: what to sample and when to update, around the learner.

Holds only recipes (`grpo`, `grpo_async`, `ppo`, `online`), their interface (`base`) and the
registry they enter themselves in (`registry`: name, config section, how the runner runs it,
report writer), which the runner, the CLI and the config-section table read. Does not own the
update's math or the model (`services.trainer.learner`), the process around a job
(`services.trainer.runner`), publishing (`services.trainer.publish`), reports
(`services.trainer.report`), a trainer's tenants (`services.trainer.tenants`) or its pacing
(`services.trainer.pacing`).
"""
