"""Where the layer-wise phase of a heal (distill.Healer) reads each layer's attention input (HealPlan.layer_inputs).

"teacher": the teacher's own hidden states at each attention, computed once a heal (LayerInputs._layer_inputs);
"student": the student's own (_own_inputs), so that each layer is fitted to what it will really read. The teacher's
attention output on its own input stays the target.
"""
from __future__ import annotations

import functools

import torch

from ..models.adapters import decoder_block, decoder_layers
from . import distributed as dd
from . import guard

# Notation: n layer-wise windows, c check windows (guard.WINDOWS), T tokens per window, dim the model's width.


class _Read(Exception):
    """Raised by _attention_input's stand-in attention once it has its input: the rest of the layer is not needed."""

    def __init__(self, x: torch.Tensor):
        super().__init__("attention input read")
        self.x = x


def _attention_input(block, layer, h: torch.Tensor) -> torch.Tensor:
    """The normed input (b, T, dim) a decoder layer's attention reads from the residual stream h, as the model's own
    block computes it (models.adapters.decoder_block), the layer left there: its attention, output norms and MLP are
    not run."""
    def read(x):
        raise _Read(x)
    try:
        block(layer, h, read)
    except _Read as got:
        return got.x
    raise ValueError("the decoder block did not call its attention")



# LayerInputs is a part of Healer: it reads the healer's plan, windows, world, device, teacher, student, attention
# modules (_attn) and budget check (_check), and keeps the inputs between steps (_inputs, _check_x, _stream,
# _stream_start, _own).
class LayerInputs:
    """The layer-wise phase's inputs, a part of distill.Healer (module docstring)."""

    def _layer_inputs(self, chunk: int = 8):
        """Each layer's attention input (n, T, dim) from the teacher on the first layer_windows windows, and on the
        guard's check windows (the next guard.WINDOWS), `chunk` windows at a time between budget checks. Over N ranks
        each computes its share and the shares are gathered; every rank makes the same number of teacher calls (each
        is a collective under FSDP2)."""
        if self._inputs is None:
            from ..models.evaluate import attention_inputs

            n = min(self.plan.layer_windows, self.windows.shape[0])
            ids = self.windows[: n + guard.WINDOWS].to(self.device)  # the spare ones last
            total = ids.shape[0]
            mine = ids[self.world.part(total)] if self.world.distributed else ids
            most = -(-total // self.world.size)  # the largest share (part_of gives the first ranks one more)
            parts, streams = [], []
            own = self.plan.layer_inputs == "student"
            hook = decoder_layers(self.teacher)[0].register_forward_pre_hook(  # the residual stream into layer 0
                lambda mod, args, kwargs: streams.append((args[0] if args else kwargs["hidden_states"]).detach()),
                with_kwargs=True) if own else None
            try:
                for c in range(-(-most // chunk)):
                    if c:
                        self._check()
                    piece = mine[c * chunk:(c + 1) * chunk]
                    run = piece if piece.shape[0] else ids[:1]
                    parts.append([x.reshape(run.shape[0], run.shape[1], -1)[: piece.shape[0]]
                                  for x in attention_inputs(self.teacher, run, stop=not self.world.distributed)])
                    if own:
                        streams[-1] = streams[-1][: piece.shape[0]]
            finally:
                if hook is not None:
                    hook.remove()
            xs = [dd.gather_rows(torch.cat(layer), total) for layer in zip(*parts)]  # (n + spare, T, dim) per layer
            self._inputs = [x[:n] for x in xs]
            # no window to spare: the first of the layer-wise ones
            self._check_x = [x[n:] if total > n else x[:guard.WINDOWS] for x in xs]
            self._stream = (0, dd.gather_rows(torch.cat(streams), total)) if own else None
        return self._inputs

    def _own_inputs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """layer_inputs "student": the layer's attention input (n, T, dim) and the check windows' (c, T, dim), from the
        student itself: the teacher's residual stream into layer 0 carried through the student's layers before this
        one as they stand (their layer-wise steps done), each decoder layer as the model runs it
        (models.adapters.decoder_block), and the layer's own input read at its attention (_attention_input), `chunk`
        windows at a time, without gradients."""
        self._layer_inputs()
        at, h = self._stream
        if at > layer:  # (not reached: the phase goes forward) carried again from the start
            at, h = 0, self._stream_start
        block, layers, chunk = decoder_block(self.student), decoder_layers(self.student), 8

        def through(i, h, attend):
            return torch.cat([block(layers[i], h[c:c + chunk], attend) for c in range(0, h.shape[0], chunk)])

        with torch.no_grad():
            if at == 0:
                self._stream_start = h
            while at < layer:
                h = through(at, h, functools.partial(self._attn[at], is_causal=True))
                at += 1
            self._stream = (at, h)
            x = torch.cat([_attention_input(block, layers[layer], h[c:c + chunk]) for c in range(0, h.shape[0], chunk)])
        n = self._inputs[layer].shape[0]
        return x[:n], x[n:] if x.shape[0] > n else x[:guard.WINDOWS]

    def _own_for(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """_own_inputs of the layer, computed once while the phase is on it."""
        if self._own is None or self._own[0] != layer:
            self._own = (layer, *self._own_inputs(layer))
        return self._own[1:]
