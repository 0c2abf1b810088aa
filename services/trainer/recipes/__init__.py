"""The recipes: orchestration around the learner.

Owns what to sample and when to update (`grpo`, `grpo_async`, `ppo`, `online`), publishing
versions (`publisher`), how a trainer yields to users (`usersfirst`), step budgets
(`budget`), run reports (`report`) and the process around a job (`job`). Does not own the
update's math or the model (`services.trainer.learner`).
"""
