"""All of `attnlab bench`: run the named suites, one result dict (the CLI renders it)."""
from __future__ import annotations

import json

from .micro import (
    convert_suite,
    decode_suite,
    deepseek_suite,
    memory_suite,
    prefill_suite,
)
from .timing import machine_info, measure_rates

SUITES = ("decode", "deepseek", "prefill", "memory", "convert", "model")



# -- all -------------------------------------------------------------------------------------------
QUICK = {
    "decode": dict(contexts=(256,), dim=256, H=4, d=64, G=2, r=64, reps=2),
    "deepseek": dict(context=128, reps=2, hidden=256, heads=4, kv_lora_rank=64, qk_nope=32, qk_rope=16, v_head=32),
    "prefill": dict(B=1, L=64, dim=128, H=4, G=2, reps=2),
    "memory": dict(dim=256, H=4, G=2, B=1, L=256),
    "convert": dict(D=256, H=8, G=2, d=32, reps=1),
    "model": dict(quick=True),
}



def run_benchmarks(suites=SUITES, quick: bool = False, progress=None, device="cpu") -> dict:
    """Run the named suites; decode and deepseek run on `device`, the others on the CPU."""
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; choose from {list(SUITES)}")
    result = {"machine": machine_info(device), "rates": measure_rates(reps=3 if quick else 5, device=device),
              "quick": quick}
    for name in suites:
        if name == "model":  # whole models: its own rates, in its own rows
            from .model import model_suite
            result[name] = model_suite(device=device, progress=progress, **(QUICK[name] if quick else {}))
            continue
        fn = {"decode": decode_suite, "deepseek": deepseek_suite, "prefill": prefill_suite,
              "memory": memory_suite, "convert": convert_suite}[name]
        kw = dict(QUICK[name]) if quick else {}
        if name == "decode":
            kw["rates"] = result["rates"]
        if name in ("decode", "deepseek"):
            kw["device"] = device
        result[name] = fn(progress=progress, **kw)
    return result



def dumps(result: dict) -> str:
    return json.dumps(result, indent=2)
