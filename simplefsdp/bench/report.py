"""The launching process's side of ``simplefsdp bench``: the table, the loss-parity verdict, the JSON and the chart."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from simplefsdp import plots
from simplefsdp.bench.contenders import CHECKED, REFERENCE

DEFAULT_PLOT = "runs/bench.png"


def _tolerance(results: dict) -> tuple[float, float]:
    """``(rtol, atol)`` for the loss check: ``assert_close``'s defaults for the parameter dtype; bitwise for
    ``aot_eager`` in full fp32, where simplefsdp and FSDP2 do the same arithmetic (with a lower ``param_dtype`` FSDP2
    also casts the fp32 rotary table, an input of each sharded block)."""
    dtype = getattr(torch, results["param_dtype"] or "float32")
    full_fp32 = dtype == torch.float32 and results["reduce_dtype"] in (None, "float32")
    if results["compile_backend"] == "aot_eager" and full_fp32:
        return 0.0, 0.0
    return {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}[dtype]


def check_parity(results: dict) -> tuple[bool, list[str]]:
    """Compare each rank's last loss of the simplefsdp rows with FSDP2 eager's; return (ok, verdict lines)."""
    rows = {row["name"]: row for row in results["rows"]}
    reference = rows.get(REFERENCE)
    if reference is None or reference["status"] != "ok":
        return True, [f"loss parity: not checked ({REFERENCE} did not run)"]
    rtol, atol = _tolerance(results)
    rule = "bitwise" if rtol == atol == 0 else f"rtol {rtol:g}, atol {atol:g}"
    ok, lines = True, []
    for name in [name for name in CHECKED if name in rows]:
        row = rows[name]
        if row["status"] != "ok":
            ok = False
            lines.append(f"loss parity: FAIL: {name} did not run ({row['reason']})")
            continue
        pairs = list(zip(row["last_loss_per_rank"], reference["last_loss_per_rank"]))
        same = all(math.isclose(mine, theirs, rel_tol=rtol, abs_tol=atol) for mine, theirs in pairs)
        ok = ok and same
        worst = max(abs(mine - theirs) for mine, theirs in pairs)
        lines.append(f"loss parity: {'ok' if same else 'FAIL'}: {name} vs {REFERENCE}, last-step loss per rank, "
                     f"{rule}: largest difference {worst:.3g}")
    return ok, lines


def _ratio(value: float | None, reference: float | None) -> str:
    return "—" if value is None or not reference else f"{value / reference:.2f}x"


def _share(milliseconds: float | None, row: dict) -> str:
    if milliseconds is None:
        return "n/a"
    return f"{milliseconds:.1f} ({100 * milliseconds / row['profiled_step_ms']:.0f}%)"


def _wire(row: dict, ref: dict | None) -> str:
    sent = row.get("wire_bytes_per_rank")  # absent from results saved before the column
    return "n/a" if sent is None else f"{sent / 2**20:.2f} ({_ratio(sent, ref and ref.get('wire_bytes_per_rank'))})"


def _workload(results: dict) -> str:
    micro = results.get("grad_accum", 1)
    accumulation = (f"{micro} micro-batches of " if micro > 1 else "")
    reduce = (f" (simplefsdp reduces after {results.get('grad_accum_reduce') or 'its default'})" if micro > 1 else "")
    return (f"{results['model']} on {results['world_size']} {results['process_group_backend']} rank(s), "
            f"{accumulation}{results['batch_size']}x{results['seq_len']} tokens per rank per step{reduce}")


def format_table(results: dict) -> str:
    """The results as a Markdown table with ratios to FSDP2 eager (and to FSDP2 with compile and to ``local`` for
    step time)."""
    rows = {row["name"]: row for row in results["rows"]}
    ok = {name: row for name, row in rows.items() if row["status"] == "ok"}
    ref, compiled, local = ok.get(REFERENCE), ok.get("fsdp2-compile"), ok.get("local")
    header = ["contender", "step s (median)", "step s (q1–q3)", "step × FSDP2", "step × FSDP2+compile", "step × local",
              "tok/s/rank", "peak MiB/rank", "mem × FSDP2", "collectives/step", "wire MiB/step (× FSDP2)",
              "comm ms/step", "wait ms/step", "warm-up s", "last loss", "Δ loss vs FSDP2"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in rows.items():
        if row["status"] != "ok":
            lines.append(f"| {name} | {row['status']}: {row['reason']} |" + " — |" * (len(header) - 2))
            continue
        median, peak = row["step_time_s"]["median"], row["peak_bytes_per_rank"]
        delta = ("n/a (own batch)" if not row["distributed"] else
                 "—" if ref is None else f"{row['last_loss'] - ref['last_loss']:+.2e}")
        cells = [
            name, f"{median:.4f}", f"{row['step_time_s']['q1']:.4f}–{row['step_time_s']['q3']:.4f}",
            *(_ratio(median, other and other["step_time_s"]["median"]) for other in (ref, compiled, local)),
            f"{row['tokens_per_s_per_rank']:,.0f}", f"{peak / 2**20:.1f}",
            _ratio(peak, ref and ref["peak_bytes_per_rank"]), str(row["collectives_per_step"]), _wire(row, ref),
            _share(row["comm_ms_per_step"], row), _share(row["wait_ms_per_step"], row),
            f"{row['warmup_s']:.1f}", f"{row['last_loss']:.6f}", delta,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_chart(results: dict, path: str | Path) -> Path:
    """Median step time and peak memory per rank of each contender, as two bar panels (n/a where it failed)."""
    ok = {row["name"]: row if row["status"] == "ok" else None for row in results["rows"]}
    return plots.bar_chart(path, f"{_workload(results)}, torch {results['torch']}", {
        "median step time (s)": {name: row and row["step_time_s"]["median"] for name, row in ok.items()},
        "peak memory per rank (MiB)": {name: row and row["peak_bytes_per_rank"] / 2**20 for name, row in ok.items()},
    })


def report(results: dict, json_path: str | None, plot_path: str | None) -> int:
    """Print the table, notes and verdicts; write the JSON and the chart; 1 when loss parity fails, else 0."""
    parity_ok, parity = check_parity(results)
    print(f"\n{_workload(results)}, {results['steps']} measured steps after {results['warmup']} warm-up, "
          f"torch {results['torch']}, {results['cpu_cores']} CPU cores, compile backend {results['compile_backend']}, "
          f"{results.get('optimizer', 'AdamW')}\n")
    print(format_table(results), end="\n\n")
    print("\n".join([*(f"- {name}: {text}" for name, text in results["methods"].items()), *parity]))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {json_path}")
    if plot_path is None and (reason := plots.missing()):
        print(f"skipped {DEFAULT_PLOT}: {reason}")
    else:
        print(f"wrote {write_chart(results, plot_path or DEFAULT_PLOT)}")
    if not parity_ok:
        print("simplefsdp bench: failed: simplefsdp did not reproduce FSDP2 eager's loss; the 'loss parity' lines "
              "above say which row, the rule and the difference", file=sys.stderr)
        return 1
    return 0
