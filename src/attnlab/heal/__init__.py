"""Healing: distil a converted model back towards the original (the teacher), which stays frozen.

Entry point: heal_model (one heal inside one budget). Beside the modules imported below: encoder.py (an encoder,
BERT, healed with a cosine loss on sentence embeddings), distributed.py and trained.py (the heal data-parallel under
torchrun: DDP or FSDP2), guard.py (what keeps a heal from leaving the model worse).
"""
from .data import PROMPTS, check_pair, read_ids, teacher_windows, text_windows  # the user's text, or the teacher's
from .distill import Healer  # layer-wise then end-to-end KL; resumable, time-budgeted
from .plan import HealPlan  # what a heal does (everything that decides its result), checked
from .run import heal_model  # evaluate, train, probe, judge, evaluate, keep the better
from .losses import distill_loss, kl_loss, normalised_mse, warmup_steps  # what a step lowers; warm-up, cosine rate
from .trainable import add_lora, freeze_all_but_attention, merge_lora  # what trains: attention weights, or LoRA
# the student against the teacher: KL, top-1 (and which positions) and greedy agreement, perplexity
from .evaluate import evaluate_pair, greedy_agreement

__all__ = ["PROMPTS", "check_pair", "read_ids", "teacher_windows", "text_windows", "HealPlan", "Healer", "add_lora",
           "distill_loss", "freeze_all_but_attention", "heal_model", "kl_loss", "merge_lora", "normalised_mse",
           "warmup_steps", "evaluate_pair", "greedy_agreement"]
