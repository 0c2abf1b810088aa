"""Reward-model scorer: a Hugging Face sequence-classification model scores (prompt, completion).

Owns: loading the model and its tokenizer at start-up (device and dtype resolved once),
turning a pair into token ids (chat template, prompt truncated from the left), batching the
pairs that arrive on the stream into forwards of at most `batch_size`, one forward at a time
in a worker thread so the event loop keeps serving, and checking what comes out (shape,
finiteness) before it becomes a reward.
Does not own: which names exist (`scorers.build_scorers`), request flow (`core.py`), or any
normalization across samples (the trainer's advantages do that).

Batching: `score` queues its items and one drain task per event loop takes up to
`batch_size` of them per forward, in arrival order. The core's stream calls `score` once per
request, so the queue fills while a forward runs and the next forward takes what came; nothing
waits for a batch to fill. One loop at a time is supported (the service has one).

Failure policy (errors are outputs, as for every scorer): a logit that is NaN or infinite,
logits that are not [batch, num_labels], or a `label_index` beyond them -> `scorer_error` with
the reason; a forward that raises -> `scorer_error` for every item of that batch, and the next
batch runs as usual; a pair the tokenizer or template cannot render -> `scorer_error` for it
alone. A model that cannot load, or whose `num_labels` has no `label_index`, stops start-up.
A bug in this module (not the model's failure) propagates to the request.

torch and transformers are imported when a model loads, never at import time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import RewardModelConfig
from .scorers import Scorer
from .types import ScoreInput, ScoreOutput

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class _Waiting:
    item: ScoreInput
    future: asyncio.Future


class RewardModelScorer(Scorer):
    """Scores pairs with a loaded sequence-classification model; see the module docstring."""

    def __init__(self, name: str, cfg: RewardModelConfig, model: Any, tokenizer: Any, device: str):
        self.name = name
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        text_cfg = model.config.get_text_config()
        # Pads with the id the model's pooling skips (it scores the last token that is not
        # this id), which need not be the tokenizer's pad id.
        self.pad_id: int | None = text_cfg.pad_token_id
        self.templated = cfg.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self._queue: deque[_Waiting] = deque()
        self._drainer: asyncio.Task | None = None
        # One forward at a time, whichever thread asks: two would split the cores (or the GPU's
        # memory) between them for no gain in throughput.
        self._forward_lock = threading.Lock()

    @classmethod
    def load(cls, name: str, cfg: RewardModelConfig) -> "RewardModelScorer":
        """Load the model and tokenizer; a bad path, a missing CUDA device or a `label_index`
        the model has no logit for raises here, at start-up."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from hotloop.hardware import describe, resolve_dtype, torch_dtype
        from hotloop.models import resolve

        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"reward model {name!r}: device = \"cuda\" but torch sees no CUDA device")
        dtype = resolve_dtype(cfg.dtype, device=device)
        log.info(describe(f"reward model {name!r} on {device}", cfg.dtype, dtype))
        path = resolve(cfg.model)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=torch_dtype(dtype), trust_remote_code=cfg.trust_remote_code,
        )
        model.to(device).eval().requires_grad_(False)
        num_labels = model.config.num_labels
        if cfg.label_index >= num_labels:
            raise ValueError(
                f"reward model {name!r}: label_index {cfg.label_index} but {path} has "
                f"num_labels = {num_labels} (indices 0..{num_labels - 1})"
            )
        text_cfg = model.config.get_text_config()
        if text_cfg.pad_token_id is None:
            # Without a pad id the model's pooling refuses batches of more than one.
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            if pad is None and cfg.batch_size > 1:
                raise ValueError(f"reward model {name!r}: neither the model nor its tokenizer has a pad or "
                                 "eos token, so it cannot score batches; set batch_size = 1")
            text_cfg.pad_token_id = pad
        limit = getattr(text_cfg, "max_position_embeddings", None)
        if limit is not None and cfg.max_length > limit:
            log.warning("reward model %r: max_length %d is beyond the model's max_position_embeddings %d",
                        name, cfg.max_length, limit)
        return cls(name, cfg, model, tokenizer, device)

    # ---- the event loop side --------------------------------------------------------------

    async def score(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]:
        if not items:
            return []
        loop = asyncio.get_running_loop()
        waiting = [_Waiting(item, loop.create_future()) for item in items]
        self._queue.extend(waiting)
        if self._drainer is None or self._drainer.done() or self._drainer.get_loop() is not loop:
            self._drainer = loop.create_task(self._drain())
        return list(await asyncio.gather(*(w.future for w in waiting)))

    async def _drain(self) -> None:
        batch: list[_Waiting] = []
        try:
            while self._queue:
                batch = []
                while self._queue and len(batch) < self.cfg.batch_size:
                    w = self._queue.popleft()
                    if not w.future.done():  # a caller that went away (closed stream) costs no forward
                        batch.append(w)
                if not batch:
                    continue
                try:
                    outs = await asyncio.to_thread(self.score_batch, [w.item for w in batch])
                except Exception as e:  # a bug here, not the model's failure: the requests see it
                    for w in batch:
                        if not w.future.done():
                            w.future.set_exception(e)
                    continue
                for w, out in zip(batch, outs):
                    if not w.future.done():
                        w.future.set_result(out)
        finally:
            # Cancelled (the loop is closing): nobody will set these any more.
            for w in (*batch, *self._queue):
                if not w.future.done():
                    w.future.cancel()

    # ---- the worker thread side ------------------------------------------------------------

    def score_batch(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]:
        """Score up to `batch_size` items with one forward (blocking; call from a thread)."""
        start = time.perf_counter()
        outs: list[ScoreOutput | None] = [None] * len(items)
        rows: list[int] = []
        ids: list[list[int]] = []
        for i, item in enumerate(items):
            try:
                encoded = self.encode(item.prompt, item.completion)
            except Exception as e:  # a template that rejects this pair fails the pair alone
                outs[i] = self._error(item, start, f"could not tokenize the pair: {type(e).__name__}: {e}")
                continue
            if not encoded:
                outs[i] = self._error(item, start, "the pair renders to no tokens")
                continue
            rows.append(i)
            ids.append(encoded)
        if rows:
            try:
                logits = self.forward(ids)
            except Exception as e:  # the model failed on this batch; the next batch runs as usual
                reason = f"reward model {self.name!r} raised {type(e).__name__}: {e}"
                log.warning("%s (batch of %d)", reason, len(rows))
                logits, problem = None, reason
            else:
                problem = self._shape_problem(logits, len(rows))
            for row, i in enumerate(rows):
                if problem is not None:
                    outs[i] = self._error(items[i], start, problem)
                    continue
                value = float(logits[row, self.cfg.label_index])
                reward = self.cfg.scale * value + self.cfg.offset
                if not math.isfinite(reward):
                    outs[i] = self._error(items[i], start, f"reward model {self.name!r} gave {value} "
                                          f"(label {self.cfg.label_index}); expected a finite number")
                else:
                    outs[i] = ScoreOutput(id=items[i].id, reward=reward,
                                          seconds=time.perf_counter() - start)
        return outs  # type: ignore[return-value]  # every slot was filled above

    def _shape_problem(self, logits: "torch.Tensor", rows: int) -> str | None:
        shape = tuple(logits.shape)
        if len(shape) != 2 or shape[0] != rows:
            return f"reward model {self.name!r} gave logits of shape {list(shape)}; expected [{rows}, num_labels]"
        if self.cfg.label_index >= shape[1]:
            return (f"reward model {self.name!r} gave {shape[1]} logits per sample; "
                    f"label_index {self.cfg.label_index} is out of range")
        return None

    def _error(self, item: ScoreInput, start: float, reason: str) -> ScoreOutput:
        return ScoreOutput(id=item.id, reward=0.0, status="scorer_error", error=reason,
                           seconds=time.perf_counter() - start)

    def forward(self, ids: Sequence[Sequence[int]]) -> "torch.Tensor":
        """Logits of right-padded `ids`, as float32 on the CPU: [len(ids), num_labels]."""
        import torch

        with self._forward_lock, torch.inference_mode():
            width = max(len(x) for x in ids)
            pad = self.pad_id if self.pad_id is not None else 0  # None only with batches of one
            input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
            mask = torch.zeros((len(ids), width), dtype=torch.long)
            for r, x in enumerate(ids):
                input_ids[r, : len(x)] = torch.tensor(x, dtype=torch.long)
                mask[r, : len(x)] = 1
            # Right padding keeps each row's positions 0..n-1, as in an unpadded forward.
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                             use_cache=False)
            return out.logits.float().cpu()

    def encode(self, prompt: str, completion: str) -> list[int]:
        """Token ids of the pair, at most `max_length`: the prompt loses tokens from its start
        (after any special tokens the tokenizer puts first, e.g. BOS) before the completion
        loses any. Without offsets (a slow tokenizer) it keeps the last `max_length` tokens."""
        tok = self.tokenizer
        if self.templated:
            user = [{"role": "user", "content": prompt}]
            head = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            text = tok.apply_chat_template([*user, {"role": "assistant", "content": completion}], tokenize=False)
            # The template writes its own special tokens; the tokenizer must not add a second BOS.
            special = False
        else:
            head, text, special = prompt, prompt + completion, True
        # Where the completion starts in `text`: usually len(head); a template that renders the
        # prompt differently once an answer follows makes it where the two first differ.
        boundary = len(os.path.commonprefix([head, text]))
        max_length = self.cfg.max_length
        fast = bool(getattr(tok, "is_fast", False))
        enc = tok(text, add_special_tokens=special, return_offsets_mapping=fast)
        ids = list(enc["input_ids"])
        if len(ids) <= max_length:
            return ids
        if not fast:
            return ids[-max_length:]
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        lead = 0  # special tokens the tokenizer added in front: no text, offsets (0, 0)
        while lead < len(ids) and offsets[lead] == (0, 0):
            lead += 1
        first = next((i for i in range(lead, len(ids)) if offsets[i][1] > boundary), len(ids))
        room = max_length - lead - (len(ids) - first)  # prompt tokens that still fit
        if room >= 0:
            return ids[:lead] + ids[first - room: first] + ids[first:]
        return ids[:lead] + ids[len(ids) - (max_length - lead):]
