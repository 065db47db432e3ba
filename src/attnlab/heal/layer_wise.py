"""The layer-wise phase of a heal (distill.Healer's LayerWise part): each converted attention module learns, one layer
at a time, to reproduce the teacher's attention output on the inputs layer_inputs.py gives it (normalised MSE, AdamW,
the plan's cosine rate), with no whole-model backward. `_layer_step` steps it on a batch chosen from (seed, layer,
step) alone; `_guard` and `judge_cut_layer` judge a finished or cut-off layer; `_fit_layers` fits the steps to the time.
"""
from __future__ import annotations

import torch

from ..runtime.budget import Budget
from . import distributed as dd
from . import guard
from .data import batch_generator
from .layer_inputs import LayerInputs
from .losses import cosine, normalised_mse, warmup_steps
from .plan import MIN_LAYER_STEPS
from .trainable import attention_modules as _modules

# Notation: n layer-wise windows, c check windows (guard.WINDOWS), T tokens per window, dim the model's width.


# LayerWise reads the healer's plan, state, teacher, attention modules (_attn), optimizer, trained part, world and the
# helpers Healer defines (_loss_value, _make_optimizer); it is not used alone.
class LayerWise(LayerInputs):
    """distill.Healer's layer-wise phase (module docstring)."""

    @property
    def layer_steps(self) -> int:
        """The layer-wise steps a layer from here: the plan's, or fewer where _fit_layers fitted them to the time."""
        return self.state.get("layer_steps") or self.plan.layer_steps

    def _layer_step(self) -> float:
        s, plan = self.state, self.plan
        layer = s["layer"]
        x_all = self._layer_inputs()[layer]  # (n, T, dim)
        idx = torch.randint(x_all.shape[0], (min(plan.layer_batch, x_all.shape[0]),),
                            generator=batch_generator(plan.seed, 1, layer, s["step"]))
        if self.world.distributed:  # this rank's rows of the one-process batch
            idx = idx[self.world.rows(idx.numel(), "layer-wise batch")]
        x = x_all[idx.to(x_all.device)]  # (b, T, dim)
        # layer_inputs "student": the student's own input there, against the teacher's output on its own input
        x_in = self._own_for(layer)[0][idx.to(x_all.device)] if plan.layer_inputs == "student" else x
        if s["step"] == 0 and s["layer_start_error"] is None:
            self._start_weights = {k: v.detach().clone() for k, v in self._attn[layer].state_dict().items()}
            s["layer_start_error"] = self._check_error(layer)
        with torch.no_grad():
            target = _modules(self.teacher)[layer](x, is_causal=True)  # (b, T, dim)
        steps = self.layer_steps
        for g in self.optimizer.param_groups:
            g["lr"] = plan.layer_lr * s["lr_scale"] * cosine(s["step"], steps, warmup_steps(steps))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.trained.part(x_in, is_causal=True)
        loss = normalised_mse(out, target, world=self.world)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        value = self._loss_value(loss)
        s["step"] += 1
        if s["step"] == steps:
            s["layer_losses"].append(value)
            self._guard(layer)
            later = [i for i in self.layers if i > layer]
            s["layer"], s["step"] = (later[0] if later else len(self._attn)), 0
            if not later:  # after a probe that found the end-to-end phase harmful: none again
                s["phase"], s["layer"] = "done" if s["probe"] == "switched" else "distill", 0
                self._inputs = self._check_x = self._stream = self._own = None
            self._make_optimizer()
        return value

    def _fit_layers(self, budget: Budget, reserve: float, seconds: float, overhead: float = 0.0) -> None:
        """Once the phase's first layer is done, the steps a layer for the layers still to come, so that they all fit
        what the budget has left but `reserve` at `seconds` a step and `overhead` a layer (carrying the student's
        stream in), at most the plan's and at least MIN_LAYER_STEPS. Set once, in the state (checkpoints hold it;
        over N ranks rank 0's figure)."""
        s = self.state
        to_come = [i for i in self.layers if i >= s["layer"]] if s["phase"] == "layers" else []
        if not to_come or budget.deadline is None or s["layer_steps"] is not None:
            return
        fit = int(((budget.left() - reserve) / len(to_come) - overhead) / max(seconds, 1e-9))
        steps = max(MIN_LAYER_STEPS, min(self.plan.layer_steps, fit))
        s["layer_steps"] = dd.broadcast_object(steps, patient=False) if self.world.distributed else steps

    def _time_layer(self, layer_clock, budget: Budget, reserve: float):
        """run()'s clock on the layer-wise phase's first layer in this call: started after its first step (which
        computes the teacher's hidden states), read when the layer is done; then the next layer's inputs are carried
        in (layer_inputs "student", timed: its first step would carry them) and the steps fitted (_fit_layers)."""
        s, clock = self.state, budget.clock
        if s["layer_steps"] is not None or budget.deadline is None:
            return None
        if layer_clock is None:
            return (s["layer"], clock()) if s["phase"] == "layers" and s["step"] == 1 else None
        layer, began = layer_clock
        if s["phase"] == "layers" and s["layer"] == layer:
            return layer_clock
        steps = self.layer_steps - 1  # the layer's steps after the clock started (the layer just ended)
        if steps <= 0:
            return None
        per_step, overhead = (clock() - began) / steps, 0.0
        if s["phase"] == "layers" and self.plan.layer_inputs == "student":
            t0 = clock()
            self._own_for(s["layer"])
            overhead = clock() - t0
        self._fit_layers(budget, reserve, per_step, overhead)
        return None

    def _check_error(self, layer: int) -> float:
        """The layer's normalised error against the teacher's layer on the check windows (no gradient; every rank
        computes the same figure from the same weights and inputs, and rank 0's is the one used)."""
        x = self._check_x[layer]  # (c, T, dim)
        own = self._own_for(layer)[1] if self.plan.layer_inputs == "student" else x
        with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            err = float(normalised_mse(self._attn[layer](own, is_causal=True),
                                       _modules(self.teacher)[layer](x, is_causal=True)))
        return dd.broadcast_object(err, patient=False) if self.world.distributed else err

    def _guard(self, layer: int) -> None:
        """End of a layer's layer-wise steps: if it ends worse on the check windows than it started, its start
        weights come back and the later steps (both phases) are GUARD_CUT times smaller; if it ended better, they
        are GUARD_CUT times larger again, up to the plan's rates (guard.after_layer); state records both."""
        s = self.state
        self.trained.release()  # FSDP2: the trained weights into the student's own module first
        before, after = s["layer_start_error"], self._check_error(layer)
        if guard.after_layer(s, layer, before, after):
            self._attn[layer].load_state_dict(self._start_weights)
        s["layer_start_error"], self._start_weights = None, None

    def judge_cut_layer(self) -> dict | None:
        """A layer the budget or a stop cut off inside its layer-wise steps, judged as _guard judges a finished one
        (worse on the check windows: its start weights back). Returns {"layer", "steps", "of", "before", "after",
        "restored"}, or None when no layer was cut or its check windows are not at hand. The state and checkpoint are
        left as they were: a resume carries on inside the layer."""
        s = self.state
        if s["phase"] != "layers" or not s["step"] or self._start_weights is None or s["layer_start_error"] is None \
                or self._check_x is None:
            return None
        self.trained.release()
        layer = s["layer"]
        before, after = s["layer_start_error"], self._check_error(layer)
        restored = guard.layer_worse(before, after)
        if restored:
            self._attn[layer].load_state_dict(self._start_weights)
        return {"layer": layer, "steps": s["step"], "of": self.layer_steps, "before": before, "after": after,
                "restored": restored}
