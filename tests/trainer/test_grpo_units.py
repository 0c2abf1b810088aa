import math

import torch

from services.trainer.grpo import TaskStream, informative, pass_at_k


def test_informative_keeps_only_groups_with_varied_rewards():
    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.5], [1.0, 1.0, 1.0], [0.2, 0.2, 0.3]])
    assert informative(rewards) == [3, 4, 5, 9, 10, 11]
    assert informative(torch.zeros(2, 4)) == []


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 10, 5) == 1.0
    assert math.isclose(pass_at_k(10, 3, 1), 0.3)
    # 1 - C(7,2)/C(10,2) = 1 - 21/45
    assert math.isclose(pass_at_k(10, 3, 2), 1 - 21 / 45)


def test_task_stream_resumes_exactly():
    tasks = list(range(7))
    a = TaskStream(tasks, seed=3)
    first = a.take(5)
    pos = a.position()
    rest = a.take(9)
    b = TaskStream(tasks, seed=3, **pos)
    assert b.take(9) == rest
    assert sorted(first + rest[:2]) == tasks  # an epoch covers every task once
