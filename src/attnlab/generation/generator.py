"""A lean whole-model forward for generation: a Llama-family causal LM driven layer by layer (`Generator`).

Like gpt-fast it shares the model's parameters and calls them directly, not transformers' forward: embed_tokens ->
layers -> norm -> lm_head (last position only). Each layer's cache is its module's KVCache or LatentCache
(`init_cache`), made once and written in place; `kv_dtype` stores it quantised or in another float type.
"""
from __future__ import annotations

import torch

from ..modules import checks
from ..modules.storage import check_kv_dtype

# Notation: B batch, P prompt length, S tokens cached so far, S_max = max_len, V vocabulary.


def _llama_parts(model):
    """(embed_tokens, layers, norm, lm_head, attnlab modules, the decoder block) of an attnlab'd Llama-family causal
    LM, or a ValueError (models.evaluate.causal_parts)."""
    from ..models.evaluate import causal_parts

    return causal_parts(model, "generation")


class Generator:
    """Prefill and decode steps of an attnlab'd Llama-family causal LM over static caches.

    prefill(input_ids, attention_mask) -> logits (B, V) of the last position; step(ids (B,)) -> logits (B, V) of the
    token just fed. `kv_bytes_per_token` is measured from the caches. The layers' attention modules are read when the
    Generator is made: make it after any conversion. Bad arguments raise ValueError or TypeError.
    """

    def __init__(self,
                 model,  # a LlamaForCausalLM after attnlab.models.to_attnlab (and possibly convert_model)
                 max_batch_size: int,  # rows the caches hold; a smaller batch uses their first rows
                 max_len: int,  # tokens a row holds: the prompt (padding included) plus those generated
                 # of the caches and activations; default the model's, whose weights must have them (model.to first)
                 dtype: torch.dtype | None = None, device=None,
                 # decode steps of one shape (default: on CUDA): the token's slot is a tensor, all max_len slots are
                 # read, the unwritten ones masked, so the step is captured once and replayed
                 *, fixed_shape: bool | None = None,
                 # that step through torch.compile(mode="reduce-overhead"), a CUDA graph on CUDA (default: on CUDA);
                 # reuse one Generator across prompts to reuse the graph
                 compile: bool | None = None,
                 # every layer's cache storage ("fp32", "bf16", "int8", "fp8", "int8/g<N>", "fp8/g<N>";
                 # modules/cache.py); default each module's own kv_dtype (None there: plain, in dtype)
                 kv_dtype: str | None = None,
                 # sliding-window layers' caches keep only their window (not with fixed_shape, whose step needs every
                 # slot); False keeps every token, the window applied by the mask alone
                 sliding: bool = True):
        checks.positive_int("max_batch_size", max_batch_size)
        checks.positive_int("max_len", max_len)
        check_kv_dtype(kv_dtype)
        self.embed, self.layers, self.norm, self.lm_head, self.modules, self._block = _llama_parts(model)
        weight = self.embed.weight
        dtype = weight.dtype if dtype is None else dtype
        device = weight.device if device is None else torch.device(device)
        if (dtype, device.type) != (weight.dtype, weight.device.type):
            raise ValueError(f"the model's weights are {weight.dtype} on {weight.device} but the Generator was "
                             f"asked for {dtype} on {device}: move the model first (model.to(...))")
        self.model, self.dtype, self.device = model, dtype, weight.device
        self.max_batch_size, self.max_len = max_batch_size, max_len
        on_cuda = self.device.type == "cuda"
        self.fixed_shape = on_cuda if fixed_shape is None else bool(fixed_shape)
        # sliding-window layers keep only their window, except for a fixed-shape step (which needs every slot)
        self._full = [m.init_cache(max_batch_size, max_len, dtype=dtype, device=self.device, kv_dtype=kv_dtype,
                                   sliding=sliding and not self.fixed_shape) for m in self.modules]
        self.caches = self._full
        self._views: dict[int, tuple[list, list | None]] = {}  # batch size -> (caches, their fixed_slot views)
        self._valid = torch.zeros(max_batch_size, max_len, dtype=torch.bool, device=self.device)  # real keys
        self.batch_size, self.length, self.padded = 0, 0, False
        compile = self.fixed_shape and on_cuda if compile is None else bool(compile)
        if compile and not self.fixed_shape:
            raise ValueError("compile=True captures the fixed-shape decode step: pass fixed_shape=True too")
        self._slot = torch.zeros(1, dtype=torch.int64, device=self.device)  # the slot a fixed-shape step writes
        self._fixed = None
        self._decode = self._fixed_step
        self.compiled = compile
        if compile:  # captured once as a CUDA graph on CUDA, replayed every step
            self._decode = torch.compile(self._fixed_step, mode="reduce-overhead", fullgraph=True)
            self._static([self._valid, self._slot])

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes all layers' caches store per token of one sequence, measured from their buffers."""
        return sum(c.bytes_per_token for c in self._full)

    def reset(self) -> None:
        """Forget every cached token (the buffers stay allocated)."""
        for c in self._full:
            c.reset()
        self.caches, self._fixed, self.batch_size, self.length, self.padded = self._full, None, 0, 0, False

    @staticmethod
    def _static(tensors) -> None:
        """Tell torch.compile these tensors keep their memory, so a CUDA graph reads and writes them in place."""
        for t in tensors:
            torch._dynamo.mark_static_address(t)

    # -- the model, layer by layer -------------------------------------------------------------
    # a layer (self._block, models.adapters.decoder_block): input_layernorm, its attnlab module over its own cache,
    # residual, post_attention_layernorm, mlp, residual (Gemma 3: its own norms around each branch)
    def _layers(self, x: torch.Tensor, caches, mask, key_padding_mask, is_causal: bool,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        for layer, attn, cache in zip(self.layers, self.modules, caches):
            x = self._block(layer, x, lambda h: attn(h, cache=cache, mask=mask, key_padding_mask=key_padding_mask,
                                                     is_causal=is_causal, positions=positions))  # (B, L, dim)
        return x

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(last))[:, 0]  # (B, V)

    def _check_ids(self, name: str, ids, dims: int) -> None:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
        if ids.dim() != dims or ids.dtype not in (torch.int64, torch.int32):
            want = "(batch, length)" if dims == 2 else "(batch,)"
            raise ValueError(f"{name} must be integer token ids of shape {want}, got {ids.dtype} "
                             f"{tuple(ids.shape)}")

    # Left padding: prompts of different lengths are padded on the left (attention_mask: 1 real, 0 pad) so that every
    # row's last token sits in the same slot and a decode step writes one slot for all rows; pad keys are masked. Every
    # token is rotated at its slot index (the cache's default positions 0..S-1), not its position in its own row. Exact:
    # a RoPE score q_i . k_j depends only on i - j, and a row with n pads has slot = position + n for all its tokens.
    # (An exact MLA in the rope_after_up layout rotates cached keys at slots 0..S-1 by construction, so slot indices
    # fit every module.) In float32 it differs from per-row positions only by the angles' rounding.
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Start afresh with a batch of prompts (B, P), left-padded; logits (B, V) of their last tokens."""
        self._check_ids("input_ids", input_ids, 2)
        B, P = input_ids.shape
        if B > self.max_batch_size:
            raise ValueError(f"a batch of {B} prompts exceeds max_batch_size {self.max_batch_size}")
        if P > self.max_len:
            raise ValueError(f"a prompt of {P} tokens does not fit max_len {self.max_len}")
        if P == 0:
            raise ValueError("input_ids holds empty prompts (length 0)")
        real = self._check_mask(attention_mask, B, P)
        self.reset()
        if B not in self._views:  # made once per batch size, so that a compiled step sees the same objects
            self._views[B] = ([c.batch_view(B) for c in self._full], None)
        self.caches, self._fixed = self._views[B]
        for c in self.caches:
            c.reset()
        self.batch_size, self.padded = B, real is not None
        ids = input_ids.to(self.device)
        mask = None
        self._valid[:B] = False
        self._valid[:B, :P] = True if real is None else real
        if real is not None:
            # causal, pad keys hidden; each token also sees itself so that no pad row is empty
            causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()  # (P, P)
            mask = causal & (real[:, None, :] | torch.eye(P, dtype=torch.bool, device=self.device))  # (B, P, P)
            mask = mask[:, None]  # (B, 1, P, P)
        x = self._layers(self.embed(ids), self.caches, mask, None, is_causal=mask is None)  # (B, P, dim)
        self.length = P
        if self.fixed_shape and self._fixed is None:
            # made after a prefill: a view shares the layout an MLA records in its cache while it is empty
            self._fixed = [c.fixed_slot(self._slot) for c in self.caches]
            self._views[B] = (self.caches, self._fixed)
            if self.compiled:
                self._static([t for c in self._fixed for t in c.tensors()])
        return self._logits(x[:, -1:])

    def _check_mask(self, attention_mask, B: int, P: int):
        """(B, P) bool of real tokens, or None when there is no padding."""
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        if tuple(attention_mask.shape) != (B, P):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {(B, P)}")
        real = attention_mask.to(self.device) != 0  # (B, P)
        if not real[:, -1].all():
            rows = torch.nonzero(~real[:, -1]).flatten().tolist()
            raise ValueError(f"attention_mask rows {rows} end in padding: pad prompts on the left "
                             "(tokenizer.padding_side = 'left')")
        if (real[:, :-1] & ~real[:, 1:]).any():
            rows = torch.nonzero((real[:, :-1] & ~real[:, 1:]).any(1)).flatten().tolist()
            raise ValueError(f"attention_mask rows {rows} have padding between real tokens; only left padding works")
        return None if real.all() else real

    @torch.no_grad()
    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (B,); logits (B, V) for the token after it."""
        if self.batch_size == 0:
            raise ValueError("step() before prefill(): start with prefill(input_ids)")
        self._check_ids("next_ids", next_ids, 1)
        if next_ids.shape[0] != self.batch_size:
            raise ValueError(f"next_ids has {next_ids.shape[0]} rows but the prompt batch had {self.batch_size}")
        if self.length >= self.max_len:
            raise ValueError(f"cannot generate past max_len {self.max_len}: the caches hold {self.length} tokens "
                             "per row (make the Generator with a larger max_len)")
        B, S = self.batch_size, self.length + 1
        ids = next_ids.to(self.device)
        if self.fixed_shape:
            self._slot.fill_(S - 1)
            logits = self._decode(ids).clone()  # a replayed graph overwrites its output
            for c in self.caches:
                c.mark_filled(S)
            self.length = S
            return logits
        self._valid[:B, S - 1] = True
        kpm = self._valid[:B, :S] if self.padded else None  # (B, S)
        x = self._layers(self.embed(ids[:, None]), self.caches, None, kpm, is_causal=True)  # (B, 1, dim)
        self.length = S
        return self._logits(x)

    # CUDA graphs: a plain decode step attends to the S tokens cached so far, a shape that changes every step. The
    # fixed-shape step attends to all S_max slots, the unwritten ones hidden by the key-padding mask, and writes its
    # token at a slot held in a tensor (_Cache.fixed_slot), so every step runs the same kernels on the same shapes and
    # torch.compile(mode="reduce-overhead") captures it once. It reads S_max keys instead of S: the price of one graph.
    def _fixed_step(self, ids: torch.Tensor) -> torch.Tensor:
        """One decode step with the same shapes at every length: it writes slot `_slot` and attends to all
        max_len slots, the unwritten ones masked. ids (B,) -> logits (B, V)."""
        valid = self._valid[:ids.shape[0]]  # (B, S_max)
        valid.index_fill_(1, self._slot, True)
        x = self._layers(self.embed(ids[:, None]), self._fixed, None, valid, is_causal=False,
                         positions=self._slot)  # (B, 1, dim)
        return self._logits(x)
