"""The verdicts on a bench run: loss parity of simplefsdp with FSDP2 eager, and the speed and memory goals."""

from __future__ import annotations

import math

import torch

from simplefsdp.bench.contenders import CHECKED, REFERENCE


def _tolerance(results: dict) -> tuple[float, float]:
    """``(rtol, atol)`` for the loss check: ``torch.testing.assert_close``'s defaults for the parameter
    dtype (fp32: 1.3e-6, 1e-5); ``(0, 0)``, bitwise, for ``aot_eager`` in full fp32, where simplefsdp and
    FSDP2 do the same arithmetic. With a lower ``param_dtype`` they do not: FSDP2 (as torchtitan
    configures it) also casts each sharded module's floating-point forward inputs, here the fp32
    rotary table, while simplefsdp casts only parameters."""
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
    for name in CHECKED:
        row = rows.get(name)
        if row is None:
            continue
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


def goal_lines(results: dict) -> list[str]:
    """Whether simplefsdp meets the goal: ≤0.75x FSDP2 eager and ≤1.2x local step time, memory ≤ FSDP2 eager."""
    ok = {row["name"]: row for row in results["rows"] if row["status"] == "ok"}
    if "simplefsdp" not in ok:
        return ["goal: not evaluated (simplefsdp did not run)"]
    lines = []
    for other, field, limit in [(REFERENCE, "step_time_s", 0.75), ("local", "step_time_s", 1.2),
                                (REFERENCE, "peak_bytes_per_rank", 1.0)]:
        if other not in ok:
            lines.append(f"goal: {field} vs {other}: not evaluated ({other} did not run)")
            continue
        value, base = (ok[name][field]["median"] if field == "step_time_s" else ok[name][field]
                       for name in ("simplefsdp", other))
        verdict = "met" if value / base <= limit else "NOT met"
        lines.append(f"goal: simplefsdp {field} ≤ {limit:g}x {other}: {verdict} ({value / base:.2f}x)")
    return lines
