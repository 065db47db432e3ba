"""Render a results JSON of `attnlab bench` as Markdown tables (for docs/performance.md).

    python benchmarks/speed/to_markdown.py benchmarks/results/bench.json
"""
import json
import sys


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return "\n".join(out)


def main(path: str) -> None:
    result = json.load(open(path))
    m, rates = result["machine"], result["rates"]
    print(f"Machine: {m.get('gpu', m['cpu'])}, {m['threads']} threads, torch {m['torch']}, Python {m['python']}; "
          f"measured float32 matmul {rates['flops_per_s'] / 1e9:.1f} GFLOP/s, "
          f"read bandwidth {rates['bytes_per_s'] / 1e9:.1f} GB/s.\n")
    for name in ("decode", "deepseek", "prefill", "memory", "convert"):
        if name in result:
            print(f"#### {name}\n\n{table(result[name])}\n")


if __name__ == "__main__":
    main(sys.argv[1])
