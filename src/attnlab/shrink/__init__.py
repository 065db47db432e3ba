"""shrink: a KV budget in, the best model attnlab can make out: plan -> convert -> heal -> export.

- plan.py      the planner: candidates measured on calibration text, the best within the budget and format
- candidate.py a plan's candidate: how it converts a model, what it is scored and ranked by
- layer_rounds.py  the planner's per-layer rounds (a latent size, bits by layer) on the winner
- request.py   what a shrink is asked (ShrinkRequest) and its check before any work
- pipeline.py  the one-command run over the library's convert, heal and export; one budget, one resumable state
- engines.py   where each output runs: the engine, its flags or cache, what scored the report
- sizes.py, baselines.py  what a cache costs; the original's cache quantized without training, scored beside a run
"""
from .candidate import Candidate, PlanResult
from .pipeline import shrink
from .plan import plan
from .request import ShrinkRequest, check_request
from .sizes import KVBudget, parse_budget

__all__ = ["ShrinkRequest", "check_request", "shrink", "Candidate", "KVBudget", "PlanResult", "parse_budget", "plan"]
