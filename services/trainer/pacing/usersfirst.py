"""How a trainer shares the host with the users the same engine serves (`users_first`).

Owns the three policies, chosen by measurement (`hotloop bench joint`; docs/architecture.md,
"PPO with joint serving"):
- `none`: the trainer computes as it likes;
- `nice`: every thread of the trainer runs at the lowest OS priority (19). Measured on 2 cores
  with 2 streaming users: no latency gain and 30% less PPO throughput, because the engine
  alone kept both cores busy and a nice-19 trainer still takes the caches and memory bandwidth;
- `pause`: the trainer stops computing while any user waits for a first token. The rollout
  streams its users' load (`Rollout.WatchLoad`), and hooks on every matmul of the decoder
  layers and on the output head (forward, and backward through a hook on the matmul's output) hold on it: on the
  same host they read the rollout's counts straight from shared memory (hotloop/loadboard.py),
  elsewhere a watcher thread turns the stream into an event. So the trainer yields within one matmul (~20 ms on 2 cores),
  not one micro-batch (seconds), and only for the prefill of users' requests: time to first
  token is protected and decoding shares the cores. One busy spell stops the trainer for at
  most `max_pause_s`; after that it computes until the rollout reports no user waiting, so
  training always progresses.
Does not own: the engine's own priority scheduling (users at priority 0, training at
`hotloop.clients.TRAINING_PRIORITY`), or which model the hooks go on (the recipe calls
`attach` with the model that computes in this process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time

from hotloop.loadboard import LoadReader
from hotloop.threads import thread_ids

log = logging.getLogger(__name__)

RECONNECT_S = 0.5  # a replica restarting: watch again after this (meanwhile nobody waits)
POLL_S = 0.001  # holding on the shared-memory board: how often to look again


class UsersFirst:
    """The trainer's side of sharing the host with users (`[ppo]` / `[online] users_first`).
    `rollout` (a replica's address) is needed by `pause` only."""

    def __init__(self, policy: str, rollout: str | None = None, max_pause_s: float = 2.0) -> None:
        if policy == "pause" and not rollout:
            raise ValueError("users_first = 'pause' watches a rollout replica: none given")
        self.policy, self.rollout, self.max_pause_s = policy, rollout, max_pause_s
        self.paused_s = 0.0  # time the compute waited for users, all spells together
        self.pauses = 0  # waits that actually waited
        self._free = threading.Event()  # set while no user waits for a first token (the stream)
        self._free.set()
        self._board = None  # the rollout's counts in shared memory, where this host sees them
        self._spell_left = max_pause_s  # what the current busy spell may still take
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream = None  # the watcher's current LoadWatch, for `close` to cancel
        self._hooks: list = []
        self.connected = threading.Event()  # the watcher has the replica's first load report

    # ---- nice ------------------------------------------------------------------------
    def start(self) -> None:
        """`nice`: call before the policy is loaded, so that every thread torch starts inherits
        the priority (Linux niceness is per thread and inherited at creation)."""
        if self.policy == "nice":
            for tid in thread_ids():
                with contextlib.suppress(OSError):  # a thread that just ended
                    os.setpriority(os.PRIO_PROCESS, tid, 19)

    # ---- pause: the watcher --------------------------------------------------------------
    def watch(self) -> None:
        """`pause`: start watching the replica's users (a daemon thread reading a blocking
        stream, so a busy trainer loop never delays the news). Stop with `close`."""
        if self.policy != "pause" or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="users-first", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import grpc

        from hotloop.clients import LoadWatch

        warned = False
        while not self._closed.is_set():
            stream = LoadWatch(self.rollout)
            self._stream = stream
            if self._closed.is_set():  # closed while connecting: `close` saw no stream yet
                stream.cancel()
            try:
                for load in stream:
                    if not self.connected.is_set() and self._board is None:
                        self._board = LoadReader.open(load.board_path, load.board_nonce)
                        log.info("users-first pause: reading the rollout's load from %s",
                                 self._board.path if self._board else "its gRPC stream "
                                 "(its shared-memory board is not visible from here)")
                    self.connected.set()
                    self.users_waiting(load.waiting > 0)
            except grpc.RpcError as e:  # the replica restarting: train on, do not fail the run
                if not warned and not self._closed.is_set():
                    log.warning("users-first: lost the rollout's load stream (%s); "
                                "training on, watching again", e.code())
                    warned = True
            finally:
                stream.cancel()
            self.users_waiting(False)
            self._closed.wait(RECONNECT_S)

    def users_waiting(self, busy: bool) -> None:
        """The watcher's news from the stream (also the unit tests' way in)."""
        if busy:
            self._free.clear()
        else:
            self._spell_left = self.max_pause_s  # the spell is over: the next gets a fresh budget
            self._free.set()

    def _busy(self) -> bool:
        board = self._board
        if board is not None:
            try:
                return board.waiting() > 0
            except ValueError:  # closed under us by `close`
                return False
        return not self._free.is_set()

    # ---- pause: the compute side ----------------------------------------------------------
    def hold(self) -> None:
        """In the computing thread (one at a time): wait while users wait for a first token,
        within the spell's budget. Returns at once when nobody waits, the budget is spent, or
        on close. With the shared-memory board it polls every millisecond (a read costs
        ~0.3 us), otherwise it waits on the stream's event."""
        if self._closed.is_set():
            return
        if not self._busy():
            self._spell_left = self.max_pause_s
            return
        if self._spell_left <= 0:
            return
        t0 = time.monotonic()
        deadline = t0 + self._spell_left
        while self._busy() and not self._closed.is_set() and (now := time.monotonic()) < deadline:
            if self._board is not None:
                time.sleep(POLL_S)
            else:
                self._free.wait(deadline - now)
        waited = time.monotonic() - t0
        self._spell_left = self.max_pause_s if not self._busy() else self._spell_left - waited
        self.paused_s += waited
        self.pauses += 1

    def attach(self, model) -> None:
        """`pause`: hook the matmuls of `model`'s decoder layers so that its forward and backward
        passes hold between them. Any model computing in this process: the policy, its colocated
        reference (the same layers, adapter off) and a shared or LoRA critic all run
        through them."""
        if self.policy != "pause" or self._hooks:
            return
        import torch

        layers = decoder_layers(model)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

        def grad_hold(grad):
            self.hold()
            return None  # the gradient unchanged

        def after(module, args, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(grad_hold)  # runs before the backward of this layer

        points = hold_points(layers, head)
        for module in points:
            self._hooks.append(module.register_forward_pre_hook(lambda module, args: self.hold()))
            self._hooks.append(module.register_forward_hook(after))
        log.info("users-first pause: %d matmuls in %d decoder layers hooked", len(points), len(layers))

    async def close(self) -> None:
        self._closed.set()
        self._free.set()  # release a compute thread waiting now
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._thread is not None:
            if self._stream is not None:
                self._stream.cancel()  # ends the watcher's blocking read
            await asyncio.to_thread(self._thread.join, 5.0)
            self._thread = None
        if self._board is not None:
            self._board.close()
            self._board = None


def hold_points(layers: list, head=None) -> list:
    """Where the compute may hold: every base-weight matmul of the layers (a Llama layer has
    seven), not the layers themselves, and the output head. One layer's backward of a
    2048-token micro-batch takes ~150 ms on 2 cores, as long as a user's whole prefill: holding
    per layer missed most of them (2.5 s held in a 171 s step beside two streaming users); one
    matmul is ~20 ms. The head is the largest matmul of all (49k outputs for SmolLM2: ~75 ms
    per 512-token chunk on 2 cores, forward or backward), and the trainer calls it once per
    chunk (`hotloop.logprobs`), so it holds per chunk. LoRA's own small matmuls
    (`lora_A`/`lora_B`) run right beside their base one and are skipped."""
    import torch

    points = [m for layer in layers for name, m in layer.named_modules()
              if isinstance(m, torch.nn.Linear) and "lora_" not in name]
    if isinstance(head, torch.nn.Linear):
        points.append(head)
    return points


def decoder_layers(model) -> list:
    """The transformer's blocks: the longest `ModuleList` whose name ends in `layers` or `h`
    (Llama/Qwen/Mistral `model.layers`, GPT-2 `transformer.h`), under peft wrappers too."""
    import torch

    best: list = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h"):
            if len(module) > len(best):
                best = list(module)
    if not best:
        raise ValueError(f"users_first = 'pause': no decoder layers found in {type(model).__name__}")
    return best
