"""The trainer service, room by room:

- `learner/`: the math and the model of an update (policy, critic, losses, checkpoints);
- `recipes/`: the algorithms (GRPO, asynchronous GRPO, PPO, the online loop), their
  interface and the registry they enter themselves in;
- `tenants/`: one online trainer for many tenants (lanes, fair share, following the registry);
- `pacing/`: when the trainer computes (step budgets, users first);
- `publish.py`: storing, pushing and announcing versions; `server.py`: the trainer's gRPC
  server (Status, FetchAdapter); `runner.py`: a job around its recipe; `report.py`: a batch
  run's report; `config.py`: the sections; `__main__.py`: the online trainer as a process.

The learner names none of the others (tests/hotloop/test_layering.py).
"""
