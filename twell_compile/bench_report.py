"""What ``twell bench`` reports: one ``Row`` per point, the printed tables, the CSV and the plot of
speedup against density."""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


def eager_reasons(outcomes: dict, direction: str) -> tuple[int, str]:
    """``replay_stats``' eager ``direction`` ("forward" or "backward") calls: their count and their
    reasons in words, most frequent first ("first call of its key 4, memory share spent 2")."""
    eager = {k.split(": ", 1)[1]: n for k, n in outcomes.items() if k.startswith(f"{direction} eager: ")}
    return sum(eager.values()), ", ".join(f"{reason} {n}" for reason, n in sorted(eager.items(), key=lambda kv: -kv[1]))


@dataclass
class Row:
    mode: str  # "inference" or "training"
    m: int
    d: int
    h: int
    variant: str  # "uniform" or "skewed"
    target_density: float
    measured_density: float
    active_per_token: float
    dense_eager_ms: float
    dense_compiled_ms: float
    twell_ms: float  # the op as dispatched (its policy picks sparse or dense per layer)
    twell_sparse_ms: float  # the Triton sparse path forced on (NaN where not measured)
    speedup_vs_eager: float
    speedup_vs_compiled: float
    sparse_speedup_vs_eager: float
    rel_err_twell: float
    rel_err_dense: float
    peak_mem_dense_mb: float = float("nan")
    peak_mem_twell_mb: float = float("nan")
    heavy_rows: int = 0  # tokens active on ~all neurons (rows the sparse path computes densely)
    overflow_rows: int = 0  # tokens active on every neuron of `overflow_tiles` TwELL tiles
    overflow_tiles: int = 0
    # ``--graphs``: dense eager and the TwELL op, each captured in one CUDA graph (NaN if not measured)
    dense_graphed_ms: float = float("nan")
    twell_graphed_ms: float = float("nan")
    speedup_graphed: float = float("nan")
    # ``--floors`` (inference): the dense gate GEMM alone and a bare gather of the bytes the sparse
    # part reads (``gather_floor``), timed with the others (NaN if not measured)
    gate_gemm_ms: float = float("nan")
    gather_floor_ms: float = float("nan")

    @property
    def floor_ms(self) -> float:
        """What the TwELL design would take with both its parts at their floors."""
        return self.gate_gemm_ms + self.gather_floor_ms

    @property
    def floor_speedup(self) -> float:
        """Dense eager time ÷ ``floor_ms``: the most this design could show at this point."""
        return self.dense_eager_ms / self.floor_ms

    @property
    def label(self) -> str:
        label = self.variant
        if self.heavy_rows:
            label += f"+{self.heavy_rows}hr"
        if self.overflow_rows:
            label += f"+{self.overflow_rows}ov{self.overflow_tiles}t"
        return label


def _graph_columns(r: Row) -> str:
    if math.isnan(r.twell_graphed_ms):
        return f" {'-':>15} {'-':>7}"
    return f" {f'{r.dense_graphed_ms:.3f}/{r.twell_graphed_ms:.3f}':>15} {r.speedup_graphed:>6.2f}x"


def print_table(rows: list[Row], file=sys.stdout) -> None:
    header = f"{'mode':<9} {'M':>6} {'variant':<16} {'density':>7} {'act/tok':>7} {'eager ms':>8} {'compiled':>8} {'twell op':>8} {'x eager':>7} {'x comp':>7} {'sparse ms':>9} {'x eager':>7} {'err sparse':>10} {'err dense':>9} {'mem d/s MB':>13}"
    graphs = any(not math.isnan(r.twell_graphed_ms) for r in rows)
    if graphs:
        header += f" {'graphs d/t ms':>15} {'x graph':>7}"
    print(header, file=file)
    print("-" * len(header), file=file)
    for r in rows:
        mem = "" if math.isnan(r.peak_mem_dense_mb) else f"{r.peak_mem_dense_mb:.0f}/{r.peak_mem_twell_mb:.0f}"
        print(
            f"{r.mode:<9} {r.m:>6} {r.label:<16} {r.measured_density:>7.2%} {r.active_per_token:>7.1f} {r.dense_eager_ms:>8.3f} {r.dense_compiled_ms:>8.3f} "
            f"{r.twell_ms:>8.3f} {r.speedup_vs_eager:>6.2f}x {r.speedup_vs_compiled:>6.2f}x {r.twell_sparse_ms:>9.3f} {r.sparse_speedup_vs_eager:>6.2f}x "
            f"{r.rel_err_twell:>10.2e} {r.rel_err_dense:>9.2e} {mem:>13}"
            + (_graph_columns(r) if graphs else ""),
            file=file,
        )


def print_floors(rows: list[Row], file=sys.stdout) -> None:
    """The ``--floors`` table: each inference point's op against the sum of its parts' floors
    (nothing if no row has them)."""
    rows = [r for r in rows if not math.isnan(r.floor_ms)]
    if not rows:
        return
    print("\nfloors (inference): the gate GEMM alone (cuBLAS) + a bare gather of the bytes the sparse part reads "
          "(kernels/floors.py)", file=file)
    header = (f"{'M':>6} {'variant':<16} {'density':>7} {'eager ms':>8} {'twell op':>8} {'sparse ms':>9} {'gate GEMM':>9} "
              f"{'gather':>8} {'floor ms':>8} {'x eager':>7} {'sparse/floor':>12}")
    print(header, file=file)
    print("-" * len(header), file=file)
    for r in rows:
        print(f"{r.m:>6} {r.label:<16} {r.measured_density:>7.2%} {r.dense_eager_ms:>8.3f} {r.twell_ms:>8.3f} "
              f"{r.twell_sparse_ms:>9.3f} {r.gate_gemm_ms:>9.3f} {r.gather_floor_ms:>8.3f} {r.floor_ms:>8.3f} "
              f"{r.floor_speedup:>6.2f}x {r.twell_sparse_ms / r.floor_ms:>11.2f}x", file=file)


def write_csv(rows: list, path: Path) -> Path:
    """``rows`` (dataclasses of one type) as a CSV with a header; creates the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    return path


def write_outputs(rows: list[Row], out_dir: Path) -> list[Path]:
    paths = [write_csv(rows, out_dir / "bench.csv")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("twell bench: matplotlib is not installed, so no plot (pip install matplotlib)", file=sys.stderr)
        return paths
    groups = sorted({(r.mode, r.m, r.label) for r in rows})
    fig, ax = plt.subplots(figsize=(11, 5))
    for mode, m, variant in groups:
        pts = sorted((r.measured_density, r.speedup_vs_eager, r.sparse_speedup_vs_eager, r.speedup_graphed) for r in rows if (r.mode, r.m, r.label) == (mode, m, variant))
        line = ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=f"twell op: {mode}, M={m}, {variant}")[0]
        ax.plot([p[0] * 100 for p in pts], [p[2] for p in pts], marker="x", ls=":", color=line.get_color(), label=f"sparse kernels forced: {mode}, M={m}, {variant}")
        graphed_pts = [p for p in pts if not math.isnan(p[3])]
        if graphed_pts:
            ax.plot([p[0] * 100 for p in graphed_pts], [p[3] for p in graphed_pts], marker="s", ls="--", color=line.get_color(),
                    label=f"both in CUDA graphs: {mode}, M={m}, {variant}")
        floor_pts = sorted((r.measured_density, r.floor_speedup) for r in rows
                           if (r.mode, r.m, r.label) == (mode, m, variant) and not math.isnan(r.floor_ms))
        if floor_pts:
            ax.plot([p[0] * 100 for p in floor_pts], [p[1] for p in floor_pts], marker="^", ls="-.", lw=0.8,
                    color=line.get_color(), alpha=0.6, label=f"floor (gate GEMM + bare gather): {mode}, M={m}, {variant}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("density of h (% of H active per token)")
    ax.set_ylabel("speedup vs dense eager (×)")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    ax.set_title(f"TwELL FFN on {device}, bf16, D={rows[0].d}, H={rows[0].h}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: the lines stay visible
    png = out_dir / "speedup_vs_density.png"
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    paths.append(png)
    return paths
