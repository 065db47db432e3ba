"""The report a shrink writes beside its output (docs/shrink.md, "The report"): bytes per token before and after,
the held-out scores, the plan, where the output runs, the work done and the minutes per phase."""
from __future__ import annotations

import torch

from ..runtime.environment import environment
from .engines import llama_cpp_cache, runs_in, transformers_cache
from .feasible import keys_whole
from .request import ShrinkRequest, pinned, plan_count
from .state import RunState


def chosen_layers(state: RunState):
    """The chosen plan's `layers` entry ([] for the original attention; None for every layer converted)."""
    return ((state.data["plan"] or {}).get("chosen") or {}).get("layers")


def final_report(req: ShrinkRequest, state: RunState, teacher, student, meta) -> dict:
    """KV bytes per token before/after, held-out perplexity (teacher, student before/after), agreement, the plan,
    minutes per phase."""
    from ..models.evaluate import kv_bytes_per_token, kv_fixed_bytes, sliding_context
    from .sizes import original_bytes, original_sizes, planned_bytes, spread_context

    L, _, _, V = original_sizes(teacher)
    whole = req.fmt == "transformers" and keys_whole(teacher) is not None and chosen_layers(state) != []
    context = req.context or sliding_context(teacher)  # sliding layers: their bytes per token depend on the context
    at_context = {"at_context": {"context": context, "original_16bit": kv_bytes_per_token(teacher, torch.bfloat16,
                                                                                         context=context),
                                 "shrunk": planned_bytes(student, context)}} if context else {}
    heal = state.data["report"].get("heal", {})
    plan = state.data["plan"] or {}
    chosen = plan.get("chosen", {})
    spread = spread_context(teacher, req.context)  # as the budget counted them: fixed rows spread over these tokens
    planned = {"as_planned": {"context": req.context, "fixed_rows_over": spread,
                              "original_16bit": original_bytes(teacher, req.context),
                              "shrunk": planned_bytes(student, req.context, spread)}}
    return {"format": "attnlab-shrink-report", "request": req.identity(),
            "kv_bytes_per_token": {"original_16bit": 2 * V * L, "shrunk": kv_bytes_per_token(student),
                                   "storage": chosen.get("kv_dtypes") or chosen.get("kv_dtype"),
                                   "fixed_per_sequence": kv_fixed_bytes(student, torch.bfloat16),  # 16-bit rows
                                   "values_per_token_per_layer": [V, chosen.get("values_per_token_per_layer")],
                                   **planned, **at_context},
            **({"llama_cpp": llama_cpp_cache(chosen.get("kv_dtype") or "bf16", chosen.get("layers") == [])}
               if req.fmt == "gguf" else {}),
            **({"transformers_cache": transformers_cache(chosen.get("kv_dtypes") or chosen.get("kv_dtype"),
                                                         chosen.get("layers") == [], whole)}
               if req.fmt == "transformers" else {}),
            "runs_in": runs_in(req.fmt, chosen, whole), "plan": plan, "heal_plan": state.data["heal_plan"],
            "held_out": {"teacher": heal.get("teacher"), "before": heal.get("before"), "after": heal.get("after")},
            "baselines": state.data["report"].get("baselines"),
            "heal": {k: v for k, v in heal.items() if k not in ("teacher", "before", "after")},
            "data": {"text": req.identity()["text"], "eval_text": req.identity()["eval_text"],
                     "calibration": ("windows spread over --text" if req.text else "text the teacher wrote (seeded)")
                     if req.calibration else "none (--no-calibration)"},
            "work": work_done(req, state), "minutes": dict(state.data["minutes"]), "base": meta.get("base"),
            "environment": environment()}


def work_done(req: ShrinkRequest, state: RunState) -> dict:
    """How much work the run did (what a loaded machine does less of; the plan is the same either way): the training
    windows written, the candidates measured, the heal's steps and tokens, and whether the work was pinned."""
    heal = state.data["report"].get("heal", {})
    plan = state.data["plan"] or {}
    return {"pinned": pinned(req), **state.data.get("work", {}),
            "candidates_measured": len(plan.get("candidates", [])) if not plan.get("explicit") else 0,
            "candidates_allowed": plan_count(req.minutes),
            "end_to_end_steps": heal.get("distill_steps"), "end_to_end_tokens": heal.get("distill_tokens"),
            "heal_steps": heal.get("steps_done"), "layer_steps_per_layer": (state.data["heal_plan"] or {}).get(
                "layer_steps")}
