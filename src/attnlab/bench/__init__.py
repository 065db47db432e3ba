"""Benchmarks: every comparison measured in one process, medians after a warm-up, rooflines from measured rates.

suites.py: `run_benchmarks`, the suites by name; timing.py: median times, the machine, its matrix-multiply rate and
bandwidth; micro.py: suites on single attention layers; model.py: whole models (`--suite model`); presets.py: the
attention sizes of real models and their KV-cache footprint.
"""
from .suites import QUICK, SUITES, dumps, run_benchmarks
from .timing import machine_info, measure_rates, median_time

__all__ = ["QUICK", "SUITES", "dumps", "run_benchmarks", "machine_info", "measure_rates", "median_time"]
