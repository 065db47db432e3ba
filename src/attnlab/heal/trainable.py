"""What a heal trains: the converted attention modules' own weights (every other parameter frozen), or LoRA adapters
(peft) on their linear maps, merged back into plain weights at the end; and those weights as one dict keyed
"<layer>.<name>" (attention_weights, load_attention_weights: what checkpoints, fingerprints and the keep-better test
hold).
"""
from __future__ import annotations

import torch

LORA_TARGETS = ("W_Q", "W_DQ", "W_UQ", "W_K", "W_V", "W_DKV", "W_KR", "W_UK", "W_UV", "W_O")


def attention_modules(model):
    """The model's attnlab attention modules, in layer order."""
    from ..models.adapters import attnlab_modules

    return attnlab_modules(model)


def freeze_all_but_attention(student, layers=None) -> list[torch.nn.Parameter]:
    """requires_grad only on the attnlab attention modules' parameters (of the layers in `layers`, default all);
    returns them."""
    for p in student.parameters():
        p.requires_grad_(False)
    params = [p for i, m in enumerate(attention_modules(student)) if layers is None or i in layers
              for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def add_lora(student, rank: int, layers=None) -> None:
    """LoRA adapters (peft) on every linear map of the attention modules (of the layers in `layers`, default all);
    only those train."""
    from peft import LoraConfig, inject_adapter_in_model

    for m in (m for i, m in enumerate(attention_modules(student)) if layers is None or i in layers):
        names = [n for n in LORA_TARGETS if getattr(m, n, None) is not None]
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=names), m)
    for p in student.parameters():
        p.requires_grad_(False)
    for m in attention_modules(student):
        for n, p in m.named_parameters():
            p.requires_grad_("lora_" in n)


def merge_lora(student) -> None:
    """Fold the LoRA adapters into the weights and put plain nn.Linear layers back."""
    from peft.tuners.lora import LoraLayer

    for m in attention_modules(student):
        for name in LORA_TARGETS:
            layer = getattr(m, name, None)
            if isinstance(layer, LoraLayer):
                layer.merge()
                setattr(m, name, layer.get_base_layer())


def attention_weights(modules) -> dict:
    """{"<layer>.<name>": tensor} of the attention modules' state, detached (what checkpoints and fingerprints hold)."""
    return {f"{i}.{k}": v.detach() for i, m in enumerate(modules) for k, v in m.state_dict().items()}


def load_attention_weights(modules, weights: dict) -> None:
    """Put attention weights saved as {"<layer>.<name>": tensor} back into the attention modules, layer by layer."""
    for i, m in enumerate(modules):
        prefix = f"{i}."
        m.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
