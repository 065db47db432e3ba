"""Conversions between MHA, GQA and MLA: module in, (module, ConversionReport) out, exact where the
mathematics allows and with a report of every error where it does not (torch and numpy only).

- exact.py       gqa_to_mha, gqa_to_mla, mla_to_mha, absorb
- lossy.py       mha_to_gqa (mean, fit), mha_to_mla (truncated SVD, whitened by calibration)
- decoupled.py   GQA with RoPE -> MLA with DeepSeek's decoupled RoPE (what keeps rotating, selection_options)
- transforms.py  RoRoPE and BKV: concentrate what a lossy cut keeps, exactly, before the cut
- report.py      ConversionReport: what a conversion must preserve, measured in float64
- choose.py      convert(): pick the conversion from the module's family and the target
- linalg.py      linear algebra on projection matrices (factorisations, folds, whitening)
- base.py        what the conversions share
"""
from .choose import TARGETS, convert
from .decoupled import ROPE_SELECTIONS, gqa_to_mla_decoupled, selection_options
from .exact import absorb, gqa_to_mha, gqa_to_mla, mla_to_mha
from .lossy import MHA_TO_GQA_METHODS, mha_to_gqa, mha_to_mla
from .report import ConversionReport, matrix_errors, probe_error

__all__ = ["TARGETS", "convert", "ROPE_SELECTIONS", "gqa_to_mla_decoupled", "selection_options", "absorb",
           "gqa_to_mha", "gqa_to_mla", "mla_to_mha", "MHA_TO_GQA_METHODS", "mha_to_gqa", "mha_to_mla",
           "ConversionReport", "matrix_errors", "probe_error"]
