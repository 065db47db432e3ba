"""Conversions between MHA, GQA and MLA: module in, (module, ConversionReport) out, exact where the mathematics allows
and with a report of every error where it does not (torch and numpy only). Entry point: convert().

Beside the modules imported below: transforms.py (RoRoPE and BKV: concentrate, exactly, what a lossy cut keeps),
linalg.py (factorisations, folds, whitening of projection matrices) and base.py (what the conversions share).
"""
from .choose import TARGETS, convert  # pick the conversion from the module's family and the target
# GQA with RoPE -> MLA with DeepSeek's decoupled RoPE; selection_options: what keeps rotating
from .decoupled import ROPE_SELECTIONS, gqa_to_mla_decoupled, selection_options
from .exact import absorb, gqa_to_mha, gqa_to_mla, mla_to_mha  # the exact conversions
from .lossy import MHA_TO_GQA_METHODS, mha_to_gqa, mha_to_mla  # mean/fit GQA; truncated-SVD MLA, calibrated
from .report import ConversionReport, matrix_errors, probe_error  # what a conversion must preserve, in float64

__all__ = ["TARGETS", "convert", "ROPE_SELECTIONS", "gqa_to_mla_decoupled", "selection_options", "absorb",
           "gqa_to_mha", "gqa_to_mla", "mla_to_mha", "MHA_TO_GQA_METHODS", "mha_to_gqa", "mha_to_mla",
           "ConversionReport", "matrix_errors", "probe_error"]
