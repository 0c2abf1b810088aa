"""The learner: the math and the model of an update.

Owns the LoRA policy and its optimizer step (`policy`), PPO's critic (`critic`), advantage
estimators and losses (`algorithms`), micro-batching (`batching`), the checkpoint layout
(`checkpoint`), the GPU memory plan (`memplan`) and the paired statistics of an evaluation
(`stats`). Does not own what to sample, when to update, or publishing: that is orchestration
(`recipes/`, `tenants/`, `pacing/`, `publish.py`, `runner.py`), which imports this package
and is never imported by it (tests/hotloop/test_layering.py).
"""
