"""Healing: distil a converted model back towards the original (the teacher), which stays frozen.

- plan.py      HealPlan: what a heal does (everything that decides its result), checked
- distill.py   Healer (layer-wise then end-to-end KL; resumable, time-budgeted)
- run.py       heal_model: one heal inside one budget (evaluate, train, probe, judge, evaluate, keep the better)
- losses.py    what a step lowers (KL, normalised MSE) and the rate schedule (warm-up, cosine)
- trainable.py what trains: the attention's own weights, or LoRA adapters on them
- data.py      what healing trains on: the user's text, or text the teacher writes itself
- evaluate.py  the student against the teacher: KL, top-1 (and which positions) and greedy agreement, perplexity
- encoder.py   healing an encoder (BERT) with a cosine loss on sentence embeddings
- distributed.py  the heal data-parallel under torchrun: the process group, DDP or FSDP2, what ranks share
- trained.py   what a phase trains, wrapped for the ranks: the module itself, its DDP wrapper, or FSDP2 twins
- guard.py     what keeps a heal from leaving the model worse: the layer-wise guard, the keep-better test
"""
from .data import PROMPTS, check_pair, read_ids, teacher_windows, text_windows
from .distill import Healer
from .plan import HealPlan
from .run import heal_model
from .losses import distill_loss, kl_loss, normalised_mse, warmup_steps
from .trainable import add_lora, freeze_all_but_attention, merge_lora
from .evaluate import evaluate_pair, greedy_agreement

__all__ = ["PROMPTS", "check_pair", "read_ids", "teacher_windows", "text_windows", "HealPlan", "Healer", "add_lora",
           "distill_loss", "freeze_all_but_attention", "heal_model", "kl_loss", "merge_lora", "normalised_mse",
           "warmup_steps", "evaluate_pair", "greedy_agreement"]
