"""What changing one layer alone costs the model: the KL to the original's next-token distributions on a few
windows, for every layer and option of a per-layer plan (the planner's round 4; the choice: shrink/per_layer.py).

The layers before the changed one are the original's, so their outputs on each window are recorded once (Prefix) and
played back: a change at layer i runs layers i..L-1, the final norm and the head. Exact; about half the work saved.
"""
from __future__ import annotations

import torch

from ..models.divergence import kl_sum


WINDOW_BATCH = 2  # windows a forward reads at once: 14% faster than one at a time on a 2-core CPU (SmolLM2)


def batches(windows: torch.Tensor) -> list[torch.Tensor]:
    """The windows (W, T) in batches of WINDOW_BATCH rows, in order."""
    return list(windows.split(WINDOW_BATCH))


class Prefix:
    """The original model's layer outputs and next-token logits on the windows (W, T), a batch of them at a time
    (batches), recorded once, for measuring changes that leave the layers before some index as they are
    (kl)."""

    def __init__(self, model, windows: torch.Tensor):
        from ..models.adapters import decoder_layers

        self.model, self.windows = model, windows
        self.layers = decoder_layers(model)
        self.outputs: list[list] = []  # [batch of windows][layer]: what the layer returned
        self.reference: list[torch.Tensor] = []  # the logits
        for batch in batches(windows):
            seen: list = []
            hooks = [layer.register_forward_hook(lambda mod, args, out: seen.append(out)) for layer in self.layers]
            try:
                with torch.no_grad():
                    logits = model(batch).logits
            finally:
                for h in hooks:
                    h.remove()
            self.reference.append(logits)
            self.outputs.append(seen)

    def kl(self, start: int) -> float:
        """Mean KL(original || model as it is now) per position over the windows, the layers before `start` played
        back from the original's outputs (the caller changed none of them); ValueError naming `start` outside
        0..L-1."""
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < len(self.layers):
            raise ValueError(f"start must be a layer index in 0..{len(self.layers) - 1}, got {start!r}")
        total, count = 0.0, 0
        for batch, ref, outs in zip(batches(self.windows), self.reference, self.outputs):
            for layer, out in zip(self.layers[:start], outs):
                layer.forward = (lambda out: lambda *args, **kwargs: out)(out)  # the original's output, not run
            try:
                with torch.no_grad():
                    student = self.model(batch).logits
            finally:
                for layer in self.layers[:start]:
                    del layer.forward  # the class's forward again
            total += kl_sum(ref, student)
            count += batch.numel()
        return total / count


def layer_costs(prefix: Prefix, count: int, options, change, restore, progress=None) -> list[list[float]]:
    """costs[l][o]: prefix.kl(l) with layer l alone changed to option o. change(l, o) changes the model in place,
    restore() undoes it (called after each, also when the change or the measurement fails); progress(done, total)
    after each measurement."""
    options = list(options)
    costs = []
    for layer in range(count):
        row = []
        for o in options:
            try:
                change(layer, o)
                row.append(prefix.kl(layer))
            finally:
                restore()
            if progress:
                progress(layer * len(options) + len(row), count * len(options))
        costs.append(row)
    return costs
