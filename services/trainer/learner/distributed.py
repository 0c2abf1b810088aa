"""Data parallelism: N ranks share each `LoraPolicy.train_step` (torch.distributed).

Owns: `make_policy`, the one factory recipes build their policy with; starting ranks 1..N-1 as
child processes of the trainer (rank 0, `Leader`) and stopping them; the process group (gloo on
the CPU, NCCL on CUDA with one GPU per rank); the protocol between rank 0 and the others (a
command line on each child's stdin, then the step's samples by broadcast); replicating rank 0's
state (adapter, critic, optimizers, step) to the others before a step that follows a build or a
restore; the deterministic split of a batch into shards (`shard`); and what `train_step`
consults on every rank where it reduces (`DataParallel`: agreed flags, summed metrics, summed
gradients). One rank is `SOLO`, whose reductions are the identity.

Why the update is the one-rank update: every rank receives the whole batch and computes the
loss normalizer and token count over all of it, so the gradients of the ranks' shards sum to
the full-batch gradient (policy.py's micro-batches already rely on this); the sum is
all-reduced before clipping, so clipping and AdamW run on identical gradients and identical
state on every rank and the replicas never drift. A skip (non-finite loss or gradient,
diverged value loss) and a stop request (polled on rank 0) are agreed by an all-reduced flag,
so no rank waits in a collective that another left.

Does not own: the update itself (policy.py runs it on every rank), scoring (rank 0 alone),
checkpoints and publishing (rank 0 alone: the state is replicated, so a checkpoint does not
depend on the world size and a run resumes at another one). A rank that dies or hangs fails
the step with `RankFailed` within `data_parallel_timeout_s`; the group is then unusable.
Ranks 1..N-1 die with rank 0: their stdin closes with it, and a watchdog polls the parent.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from services.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from services.trainer.learner.batching import Sample
    from services.trainer.learner.critic import Critic
    from services.trainer.learner.policy import LoraPolicy, StepMetrics

    Update = Callable[[Sequence[Sample], Callable[[], bool] | None, Critic | None], StepMetrics]

__all__ = ["SOLO", "DataParallel", "Leader", "RankFailed", "backend_for", "make_policy",
           "rank_devices", "serve", "shard"]

log = logging.getLogger(__name__)
RANK_MODULE = "services.trainer.learner.rank"  # what a child runs (rank.py)
_HOST = "127.0.0.1"
_CLOSE_WAIT_S = 10.0  # how long `close` lets a rank exit by itself before it is killed
_START_S = 900.0  # how long ranks may take to start and load the model


class RankFailed(RuntimeError):
    """A data-parallel rank died, hung past the timeout, or failed; the group is unusable."""


def backend_for(device: str) -> str:
    """The process group's backend for the policy's device: NCCL between GPUs, else gloo."""
    return "nccl" if device == "cuda" else "gloo"


def rank_devices(device: str, world: int, gpus: int) -> list[str]:
    """The device of each rank: the CPU for all, or on CUDA `cuda:<rank>` (NCCL needs a GPU
    per rank); more ranks than `gpus` is an error that says so."""
    if device != "cuda":
        return ["cpu"] * world
    if world > gpus:
        raise ValueError(f"[trainer] data_parallel = {world} with device cuda needs one GPU per "
                         f"rank, but torch sees {gpus}; set data_parallel to at most {gpus}")
    return [f"cuda:{r}" for r in range(world)]


def shard(samples: Sequence[Sample], world: int) -> list[list[int]]:
    """The indices of `samples` each rank trains: a deterministic function of the batch, so
    every rank computes the same split. The samples of one prompt stay together (a rank runs
    their shared prompt once, `share_prompts`), unless there are fewer prompts than ranks;
    the largest units go first, each to the rank with the fewest tokens so far."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(s.prompt_ids), []).append(i)
    units = list(groups.values()) if len(groups) >= world else [[i] for i in range(len(samples))]

    def cost(unit: list[int]) -> int:  # the prompt runs once per unit
        return len(samples[unit[0]].prompt_ids) + sum(len(samples[i].completion_ids) for i in unit)

    load, out = [0] * world, [[] for _ in range(world)]
    for unit in sorted(units, key=lambda u: (-cost(u), u[0])):
        r = min(range(world), key=lambda k: (load[k], k))
        out[r] += unit
        load[r] += cost(unit)
    return [sorted(o) for o in out]


class DataParallel:
    """One rank's view of the group: what `LoraPolicy.train_step` consults where it reduces.
    Every rank calls these in the same order (they are collectives). The base class is one
    rank alone (`SOLO`): every reduction is the identity."""

    rank, world = 0, 1

    def shard(self, samples: Sequence[Sample]) -> list[Sample]:
        """This rank's share of the batch."""
        return list(samples)

    def agree(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (the same answer on all of them)."""
        return flag

    def counts(self, n: int) -> list[int]:
        """Every rank's `n`, in rank order."""
        return [n]

    def sum_metrics(self, total: float, sums: dict[str, float]) -> tuple[float, dict[str, float]]:
        """The loss and the metric sums over the ranks (a key missing on a rank adds 0)."""
        return total, sums

    def sum_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Sum every rank's gradients of `params` in place."""

    def step(self, policy: LoraPolicy, update: Update, samples: Sequence[Sample],
             should_stop: Callable[[], bool] | None, critic: Critic | None) -> StepMetrics:
        """Run `update` on this rank (rank 0 first hands the step to the others)."""
        return update(samples, should_stop, critic)

    def state_changed(self) -> None:
        """The policy's state changed outside `train_step` (a restore): the other ranks take
        rank 0's before the next step."""

    def close(self) -> None:
        """Stop the other ranks (rank 0) and leave the group."""


SOLO = DataParallel()


class _Group(DataParallel):
    """A rank of a torch.distributed group of `world` > 1 ranks."""

    def __init__(self, rank: int, world: int, device: str) -> None:
        self.rank, self.world, self.device = rank, world, torch.device(device)

    def shard(self, samples: Sequence[Sample]) -> list[Sample]:
        return [samples[i] for i in shard(samples, self.world)[self.rank]]

    def agree(self, flag: bool) -> bool:
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def counts(self, n: int) -> list[int]:
        t = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        t[self.rank] = n
        dist.all_reduce(t)
        return [int(x) for x in t.tolist()]

    def sum_metrics(self, total: float, sums: dict[str, float]) -> tuple[float, dict[str, float]]:
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (total, sums))
        out: dict[str, float] = {}
        for _, d in gathered:
            for k, v in d.items():
                out[k] = out.get(k, 0.0) + v
        return sum(t for t, _ in gathered), out

    def sum_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """One all-reduce of every gradient, flattened, with a flag per parameter: one that no
        rank's graph reached keeps `grad = None`, as on one rank (AdamW then leaves it alone,
        where a zero gradient would still move it through its moments)."""
        flat = [p.grad.reshape(-1).float() if p.grad is not None
                else torch.zeros(p.numel(), device=self.device) for p in params]
        reached = torch.tensor([float(p.grad is not None) for p in params], device=self.device)
        buf = torch.cat([*flat, reached])
        dist.all_reduce(buf)
        flags = buf[-len(params):].tolist()
        offset = 0
        for p, flag in zip(params, flags):
            n = p.numel()
            if flag > 0:
                g = buf[offset:offset + n].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            offset += n

    def receive(self) -> list[Any]:
        """Rank 0's message of the step (`Leader.step`)."""
        msg: list[Any] = [None] * 4
        dist.broadcast_object_list(msg, src=0, device=self._object_device())
        return msg

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None


# ---- rank 0 -------------------------------------------------------------------------------------


def _cpu(obj: Any) -> Any:
    """`obj` with every tensor moved to the CPU (an optimizer's state_dict, for pickling)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _state(policy: LoraPolicy, critic: Critic | None) -> dict[str, Any]:
    """What makes another rank's replica identical to rank 0's."""
    out: dict[str, Any] = {
        "step": policy.step,
        "params": [p.detach().cpu() for p in policy.trainable_tensors()],
        "optimizer": _cpu(policy.optimizer.state_dict()),
        "critic": None,
    }
    if critic is not None:
        out["critic"] = {"params": [p.detach().cpu() for p in critic.params],
                         "optimizer": _cpu(critic.optimizer.state_dict())}
    return out


def _load_state(policy: LoraPolicy, critic: Critic | None, state: dict[str, Any]) -> None:
    with torch.no_grad():
        for p, v in zip(policy.trainable_tensors(), state["params"], strict=True):
            p.copy_(v)
        if critic is not None:
            for p, v in zip(critic.params, state["critic"]["params"], strict=True):
                p.copy_(v)
    policy.optimizer.load_state_dict(state["optimizer"])
    if critic is not None:
        critic.optimizer.load_state_dict(state["critic"]["optimizer"])
    policy.step = state["step"]


class Leader(_Group):
    """Rank 0, the trainer process: starts ranks 1..N-1, hands them each step, stops them."""

    def __init__(self, cfg: TrainerConfig, model_dir: Path | None) -> None:
        from hotloop.hardware import resolve_device

        if dist.is_initialized():
            raise RuntimeError("this process already holds a torch.distributed group: one "
                               "data-parallel policy per process (close the other first)")
        device = resolve_device(cfg.device)
        world = cfg.data_parallel
        gpus = torch.cuda.device_count() if device == "cuda" else 0
        devices = rank_devices(device, world, gpus)
        super().__init__(0, world, devices[0])
        if device == "cuda":
            torch.cuda.set_device(self.device)  # the policy's "cuda" is this rank's GPU
        self.timeout_s = cfg.data_parallel_timeout_s
        self.broken: str | None = None  # why the group is unusable
        self._store: dist.TCPStore | None = None
        self._stale = True  # the others need rank 0's state before the next step
        self._critic: Critic | None = None  # the critic whose state they hold
        self._procs: list[subprocess.Popen] = []
        timeout = timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(_HOST, 0, world, is_master=True, timeout=timeout,
                              wait_for_workers=False)  # they start below
        # The children run the code this process runs, wherever it was imported from.
        root = str(Path(__file__).resolve().parents[3])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        cfg_json = cfg.model_copy(update={"device": device}).model_dump(mode="json")
        try:
            for rank in range(1, world):
                # A session of their own: a Ctrl-C at the terminal reaches rank 0 alone, which
                # stops the step on every rank (an agreed flag) and then closes them.
                proc = subprocess.Popen([sys.executable, "-m", RANK_MODULE], stdin=subprocess.PIPE,
                                        env=env, start_new_session=True)
                self._procs.append(proc)
                init = {"rank": rank, "world": world, "port": store.port, "device": devices[rank],
                        "timeout_s": self.timeout_s, "parent": os.getpid(),
                        "model_dir": None if model_dir is None else str(model_dir),
                        "cfg": cfg_json}
                proc.stdin.write((json.dumps(init) + "\n").encode())
                proc.stdin.flush()
            self._store = store
            self._wait_for("up", "joining the group")
            dist.init_process_group(backend_for(device), store=store, rank=0, world_size=world,
                                    timeout=timeout)
        except BaseException:
            self.close()
            raise
        log.info("data parallel: %d ranks (%s) on %s", world, backend_for(device),
                 ", ".join(devices))

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The other ranks' processes, rank 1 first."""
        return list(self._procs)

    def _wait_for(self, key: str, what: str) -> None:
        """Until every other rank has set `key/<rank>` in the store (start-up happens outside
        any collective, so it is bounded by `_START_S`, not by the step timeout)."""
        keys = [f"{key}/{r}" for r in range(1, self.world)]
        deadline = time.monotonic() + _START_S
        while not self._store.check(keys):
            self._check_alive(what)
            if time.monotonic() > deadline:
                raise RankFailed(f"data-parallel ranks did not finish {what} within {_START_S:g} s")
            time.sleep(0.05)

    def _check_alive(self, what: str) -> None:
        if self.broken is not None:
            raise RankFailed(f"the data-parallel group failed earlier: {self.broken}")
        dead = [(r, p.returncode) for r, p in enumerate(self._procs, 1) if p.poll() is not None]
        if dead:
            self.broken = "; ".join(f"rank {r} exited with code {c}" for r, c in dead) \
                + f" while {what} (its output is above)"
            raise RankFailed(f"data parallel: {self.broken}")

    def ready(self) -> None:
        """Wait until every rank has built its policy; `RankFailed` if one died meanwhile."""
        self._wait_for("ready", "building the policy")

    def state_changed(self) -> None:
        self._stale = True

    def step(self, policy: LoraPolicy, update: Update, samples: Sequence[Sample],
             should_stop: Callable[[], bool] | None, critic: Critic | None) -> StepMetrics:
        """Hand the step to the other ranks (a "train" line, then the samples, the objective,
        the critic's settings and, after a build or a restore, rank 0's state), then run it
        here. An error that leaves the ranks out of step breaks the group: `RankFailed`."""
        from services.trainer.learner.policy import Interrupted

        self._check_alive("starting a step")
        sync = self._stale or critic is not self._critic
        msg = [samples, policy.algorithm, None if critic is None else critic.cfg,
               _state(policy, critic) if sync else None]
        try:
            for proc in self._procs:
                proc.stdin.write(b"train\n")
                proc.stdin.flush()
            dist.broadcast_object_list(msg, src=0, device=self._object_device())
            self._stale, self._critic = False, critic
            return update(samples, should_stop, critic)
        except Interrupted:
            raise
        except BaseException as e:
            raise self._failure(e) from e

    def _failure(self, error: BaseException) -> BaseException:
        """`RankFailed` that says which rank died, or that a collective timed out; the group is
        broken either way (the ranks are no longer at the same point of the step)."""
        try:
            self._check_alive("in a step")
        except RankFailed as failed:
            return failed
        self.broken = f"{type(error).__name__}: {error}"
        if isinstance(error, (dist.DistError, BrokenPipeError)) or "gloo" in str(error).lower():
            return RankFailed(
                f"data parallel: a collective failed ({error}); a rank hangs, or a step ran "
                f"longer than [trainer] data_parallel_timeout_s = {self.timeout_s:g} s")
        return error

    def close(self) -> None:
        """Tell every rank to exit and wait for it (a rank that does not exit within
        `_CLOSE_WAIT_S` is killed: it hangs in a collective of a broken group), then leave the
        process group. Idempotent."""
        for proc in self._procs:
            try:
                if self.broken is not None:  # it hangs in a collective, or is gone
                    proc.kill()
                proc.stdin.write(b"close\n")
                proc.stdin.close()
            except OSError:  # it is gone already
                pass
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []
        if dist.is_initialized():
            dist.destroy_process_group()
        self.broken = self.broken or "closed"


def make_policy(cfg: TrainerConfig, model_dir: Path | None = None) -> LoraPolicy:
    """The policy a recipe trains: a `LoraPolicy`, whose `train_step` runs on
    `cfg.data_parallel` ranks (this process is rank 0). Close it (`LoraPolicy.close`) when
    done: that stops the other ranks."""
    from services.trainer.learner.policy import LoraPolicy

    if cfg.data_parallel == 1:
        return LoraPolicy(cfg, model_dir)
    leader = Leader(cfg, model_dir)
    try:
        policy = LoraPolicy(cfg, model_dir, dp=leader)
        leader.ready()
    except BaseException:
        leader.close()
        raise
    return policy


# ---- ranks 1..N-1 -------------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """Exit when rank 0 is gone (its pid is no longer this process's parent), wherever the
    main thread is blocked."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


def serve(init: dict[str, Any]) -> None:
    """A child rank (rank.py): join the group, build the same policy as rank 0, then run rank
    0's steps until it says "close" or goes away (stdin closes)."""
    from services.trainer.config import CriticSettings
    from services.trainer.learner.critic import make_critic
    from services.trainer.learner.policy import Interrupted, LoraPolicy

    threading.Thread(target=_watch_parent, args=(init["parent"],), daemon=True).start()
    rank, world, device = init["rank"], init["world"], init["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=init["timeout_s"])
    store = dist.TCPStore(_HOST, init["port"], world, is_master=False, timeout=timeout)
    store.set(f"up/{rank}", "1")
    dist.init_process_group(backend_for(device.split(":")[0]), store=store, rank=rank,
                            world_size=world, timeout=timeout)
    group = _Group(rank, world, device)
    cfg = TrainerConfig.model_validate(init["cfg"])
    policy = LoraPolicy(cfg, init["model_dir"] and Path(init["model_dir"]), dp=group)
    store.set(f"ready/{rank}", "1")  # Leader.ready
    critic: Critic | None = None
    while (line := sys.stdin.buffer.readline().strip()) == b"train":
        samples, algorithm, critic_cfg, state = group.receive()
        policy.algorithm = algorithm
        if critic_cfg is not None and critic is None:
            critic = make_critic(policy, CriticSettings.model_validate(critic_cfg))
        elif critic_cfg is not None and critic_cfg != critic.cfg:
            raise RuntimeError("rank 0 changed its critic's settings; a rank builds one critic")
        if state is not None:
            _load_state(policy, critic if critic_cfg is not None else None, state)
        try:
            policy.train_step(samples, critic=critic if critic_cfg is not None else None)
        except Interrupted:
            pass
    if line not in (b"close", b""):
        raise RuntimeError(f"unknown command from rank 0: {line!r}")
    dist.destroy_process_group()
