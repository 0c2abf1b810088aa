"""The trainer's config fixture: `train-step` measures the trainer's own LoRA step."""

from tests.trainer.conftest import make_cfg  # noqa: F401  (a fixture, found by name)
