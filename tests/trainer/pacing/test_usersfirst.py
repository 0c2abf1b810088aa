"""`UsersFirst` (services/trainer/pacing/usersfirst.py): the `pause` policy holds a model's forward
and backward between decoder layers while users wait for a first token, within a per-spell
budget, and through a real rollout's WatchLoad stream."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from services.trainer.pacing.usersfirst import UsersFirst, decoder_layers


def tiny_llama(layers: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def counting(users: UsersFirst) -> list[str]:
    """Record where `hold` is called from (forward or backward)."""
    calls: list[str] = []
    real = users.hold

    def hold():
        calls.append("grad" if _in_backward() else "fwd")
        real()

    users.hold = hold
    return calls


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@pytest.mark.parametrize("lora", [False, True])
def test_hooks_hold_at_every_matmul_forward_and_backward(lora):
    model = tiny_llama(3)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    users = UsersFirst("pause", rollout="unused:0")
    calls = counting(users)
    users.attach(model)
    n = 3 * 7 + 1  # q, k, v, o, gate, up, down per layer, the head; not LoRA's own matmuls
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    # Under LoRA the first layer's q/k/v base matmuls read the frozen embeddings with frozen
    # weights: nothing flows back through them, so they have no backward to hold before.
    grads = n - 3 if lora else n
    assert calls.count("fwd") == n and calls.count("grad") == grads, calls
    with torch.no_grad():  # the colocated reference and critic values: forward only
        model(input_ids=x)
    assert calls.count("fwd") == 2 * n and calls.count("grad") == grads
    asyncio.run(users.close())
    model(input_ids=x)
    assert len(calls) == 2 * n + grads  # closed: hooks removed


def test_the_trainers_chunked_head_holds_once_per_chunk_forward_and_backward():
    from hotloop.logprobs import collate, completion_logprobs

    model = tiny_llama(1)
    users = UsersFirst("pause", rollout="unused:0")
    calls = counting(users)
    users.attach(model)
    batch = collate([([1, 2, 3, 4], [5, 6, 7, 8, 9]), ([3, 4], [10, 11, 12, 13, 14])])
    lp = completion_logprobs(model, batch, chunk_tokens=3)  # 10 completion tokens: 4 chunks
    lp.logprobs.sum().backward()
    assert calls.count("fwd") == 7 + 4 and calls.count("grad") == 7 + 4, calls
    asyncio.run(users.close())


def test_hold_waits_while_users_wait_and_resumes_when_they_are_served():
    users = UsersFirst("pause", rollout="unused:0", max_pause_s=5.0)
    users.users_waiting(True)
    threading.Timer(0.2, users.users_waiting, args=(False,)).start()
    t0 = time.monotonic()
    users.hold()
    waited = time.monotonic() - t0
    # released by the users' news (the timer fires no sooner than 0.2 s), not by the budget
    assert 0.15 < waited < users.max_pause_s and users.pauses == 1
    paused_s = users.paused_s
    users.hold()  # nobody waits: no wait
    assert users.pauses == 1 and users.paused_s == paused_s


def test_one_busy_spell_stops_training_at_most_max_pause_s():
    users = UsersFirst("pause", rollout="unused:0", max_pause_s=0.2)
    users.users_waiting(True)
    t0 = time.monotonic()
    for _ in range(5):  # every layer of a pass asks; the spell's budget is shared
        users.hold()
    assert time.monotonic() - t0 >= 0.2  # the first waited the whole budget ...
    assert users.pauses == 1  # ... and the other four did not wait at all
    users.users_waiting(True)  # still the same spell: no fresh budget
    users.hold()
    assert users.pauses == 1
    users.users_waiting(False)
    users.users_waiting(True)  # a new spell: a new budget
    t0 = time.monotonic()
    users.hold()
    assert time.monotonic() - t0 >= 0.15 and users.pauses == 2


def test_close_releases_a_waiting_compute_thread():
    users = UsersFirst("pause", rollout="unused:0", max_pause_s=30.0)
    users.users_waiting(True)
    t = threading.Thread(target=users.hold)
    t.start()
    time.sleep(0.1)
    asyncio.run(users.close())
    t.join(20.0)  # well under the 30 s budget that would release it without `close`
    assert not t.is_alive()


def test_a_watcher_of_an_unreachable_replica_retries_quietly_and_stops_on_close():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    users = UsersFirst("pause", rollout=f"127.0.0.1:{port}")
    users.watch()
    time.sleep(1.2)  # at least one failed stream and one reconnect wait
    assert users._thread.is_alive() and not users.connected.is_set()
    assert not users._busy()  # nobody is known to wait: training goes on
    t0 = time.monotonic()
    asyncio.run(users.close())
    assert users._thread is None and time.monotonic() - t0 < 2.0


def test_other_policies_hook_nothing_and_pause_needs_a_replica():
    model = tiny_llama(2)
    UsersFirst("none").attach(model)
    assert not any(layer._forward_pre_hooks for layer in decoder_layers(model))
    with pytest.raises(ValueError, match="rollout replica"):
        UsersFirst("pause")


def test_decoder_layers_are_found_under_peft_and_missing_ones_are_an_error():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(4), LoraConfig(r=2, target_modules="all-linear"))
    assert len(decoder_layers(model)) == 4
    with pytest.raises(ValueError, match="no decoder layers"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_pause_holds_on_the_board_without_the_stream(tmp_path):
    from hotloop.loadboard import LoadBoard, LoadReader

    board = LoadBoard(tmp_path)
    users = UsersFirst("pause", rollout="unused:0", max_pause_s=5.0)
    users._board = LoadReader.open(str(board.path), board.nonce)
    try:
        users.hold()
        assert users.pauses == 0  # nobody waits
        board.write(1, 1)
        threading.Timer(0.2, board.write, args=(1, 0)).start()  # the first token came
        t0 = time.monotonic()
        users.hold()
        # released by the board (the timer fires no sooner than 0.2 s), not by the budget
        assert 0.15 < time.monotonic() - t0 < users.max_pause_s and users.pauses == 1
    finally:
        asyncio.run(users.close())
        board.close()
