"""Benchmarks: every comparison measured in one process, medians after a warm-up, rooflines from measured rates.

- timing.py   median times, the machine, its measured matrix-multiply rate and bandwidth
- micro.py    decode, DeepSeek, prefill, memory and convert suites on single attention layers
- model.py    whole models: prefill, decode, peak memory, roofline (`--suite model`)
- suites.py   run_benchmarks(): the suites by name
- presets.py  attention sizes of real models and their KV-cache footprint
"""
from .suites import QUICK, SUITES, dumps, run_benchmarks
from .timing import machine_info, measure_rates, median_time

__all__ = ["QUICK", "SUITES", "dumps", "run_benchmarks", "machine_info", "measure_rates", "median_time"]
