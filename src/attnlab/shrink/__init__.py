"""shrink: a KV budget in, the best model attnlab can make out: plan -> convert -> heal -> export (shrink()).

Beside the modules imported below: layer_rounds.py (the planner's per-layer rounds on the winner: a latent size, bits
by layer), engines.py (where each output runs: the engine, its flags or cache, what scored the report) and
baselines.py (the original's cache quantized without training, scored beside a run).
"""
from .candidate import Candidate, PlanResult  # a plan's candidate: how it converts a model, what it is ranked by
from .pipeline import shrink  # the one-command run over convert, heal and export; one budget, one resumable state
from .plan import plan  # the planner: candidates measured on calibration text, the best within the budget and format
from .request import ShrinkRequest, check_request  # what a shrink is asked, and its check before any work
from .sizes import KVBudget, parse_budget  # what a cache costs

__all__ = ["ShrinkRequest", "check_request", "shrink", "Candidate", "KVBudget", "PlanResult", "parse_budget", "plan"]
