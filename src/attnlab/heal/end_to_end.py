"""The end-to-end phase of a heal (distill.Healer's EndToEnd part): KL(teacher || student) of the next-token
distributions over whole windows, training only the converted attention weights (or LoRA adapters on them), and its
blow-up guard (guard.py decides, this part acts: the comment above _keep_good). `_distill_step` steps on the batch
chosen from (seed, epoch, position) alone (`_batch`: every epoch a permutation of the training windows).
"""
from __future__ import annotations

import contextlib

import torch

from . import guard
from .data import batch_generator
from .losses import cosine, kl_loss
from .trainable import attention_weights

# Notation: B windows per step, T tokens per window, V vocabulary.


# EndToEnd reads the healer's plan, state, teacher, windows, world, device, optimizer and trained part and the helpers
# Healer defines (_trained_params, _put, _loss_value, _make_optimizer); it is not used alone.
class EndToEnd:
    """distill.Healer's end-to-end phase and its blow-up guard (module docstring)."""

    def _batch(self, step: int) -> torch.Tensor:
        B, N = self.plan.batch_size, self.windows.shape[0]
        rows = []
        for k in range(step * B, (step + 1) * B):
            epoch, pos = divmod(k, N)
            rows.append(int(torch.randperm(N, generator=batch_generator(self.plan.seed, 2, epoch))[pos]))
        return self.windows[rows].to(self.device)  # (B, T)

    def _distill_step(self) -> float:
        s, plan = self.state, self.plan
        self.trained.attach(self.state["phase"])
        ids = self._batch(s["step"])  # (B, T): the whole batch
        mine = ids[self.world.rows(ids.shape[0])] if self.world.distributed else ids  # this rank's rows
        for g in self.optimizer.param_groups:
            g["lr"] = plan.lr * s["lr_scale"] * cosine(s["step"], s["total_steps"] or 10 ** 9, plan.warmup)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            with torch.no_grad():
                t_logits = self.teacher(mine).logits
            loss = kl_loss(t_logits, self.trained.part(mine).logits)
        value = self._loss_value(loss)  # the whole batch's, the same on every rank: the ranks decide alike
        past = self._good is not None and guard.past_line(s, value)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # before a look at the good weights: swapping them in would change what the graph saved
        del loss
        self._rolled_back = False
        if past:  # the weights the last steps left read badly; a batch hard for the good weights too stands
            good_loss = self._good_loss(mine, t_logits)
            self._rolled_back = guard.blown_up(s, value, good_loss)
            if self._rolled_back:
                del t_logits
                self._roll_back(value, good_loss)
                return value
            guard.hard_batch(s, value, good_loss)
        del t_logits
        if guard.good(s, value):
            self._keep_good()
        # the global norm: DDP's gradients are the averaged ones on every rank; FSDP2's are DTensor shards
        torch.nn.utils.clip_grad_norm_(self._trained_params(), 1.0)
        self.optimizer.step()
        s["step"] += 1
        s["tokens"] += ids.numel()
        s["distill_losses"].append(value)
        if s["total_steps"] is not None and s["step"] >= s["total_steps"]:
            s["phase"] = "done"
            self._make_optimizer()  # none: the trained weights are the student's own again
        return value

    # The blow-up guard: a step past guard.BLOW_UP times the phase's first loss is asked again with the last good
    # weights on its own batch (_good_loss, one more forward, only past that line); above that line too, it is rolled
    # back (_roll_back: the good weights back, the rates cut, a new optimizer), else it stands as a hard batch. The
    # good weights are a copy of the trained parameters renewed at each step that reads no worse than the first
    # (_keep_good); checkpoints hold them as weights (_good_weights).
    def _keep_good(self) -> None:
        """The blow-up guard's copy of the trained parameters as they are now (they just read no worse than the
        phase's first step: guard.good), in place."""
        params = self._trained_params()
        if self._good is None:
            self._good = [p.detach().clone() for p in params]
        else:
            with torch.no_grad():
                for g, p in zip(self._good, params, strict=True):
                    g.copy_(p)

    @contextlib.contextmanager
    def _good_in_place(self):
        """The blow-up guard's last good weights in the trained parameters for the block, the current ones back
        after it."""
        current = [p.detach().clone() for p in self._trained_params()]
        self._put(self._good)
        try:
            yield
        finally:
            self._put(current)

    def _good_loss(self, ids: torch.Tensor, t_logits: torch.Tensor) -> float:
        """The loss of the blow-up guard's last good weights on the step's batch (this rank's rows `ids`, the
        teacher's logits on them): put into the trained parameters for one forward, the current ones back after."""
        with self._good_in_place(), torch.no_grad(), \
                torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = kl_loss(t_logits, self.trained.part(ids).logits)
        return self._loss_value(loss)

    def _roll_back(self, loss: float, good_loss: float) -> None:
        """The end-to-end step at state["step"] read `loss`, past guard.BLOW_UP times the phase's first and the last
        good weights' on its batch (guard.blown_up): the trained parameters of the last step that read well
        (guard.good) come back, the rates are divided by guard.GUARD_CUT, and a new optimizer (and, over N ranks, a
        new wrapper) starts from them; the step is taken again, on its own batch."""
        guard.rolled_back(self.state, loss, good_loss)
        self._put(self._good)
        self._make_optimizer()

    def _good_weights(self) -> dict | None:
        """The blow-up guard's copy of the last good end-to-end weights as the checkpoint holds weights ({"<layer>.
        <name>": tensor} on the CPU), or None: put into the trained parameters for a moment (FSDP2: gathered into the
        student's modules, a collective every rank runs), then the current ones back."""
        if self._good is None or self.optimizer is None:
            return None
        with self._good_in_place():
            self.trained.sync()
            good = {k: v.cpu().clone() for k, v in attention_weights(self._attn).items()} if self.world.main else None
        self.trained.sync()
        return good
