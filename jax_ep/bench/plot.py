"""PNG plots of benchmark results: bandwidth vs tokens per rank (normal mode), latency (low latency)."""

from __future__ import annotations

import os


def plot_results(results, out_dir, machine):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ok = [r for r in results if "error" not in r and r.get("kind") in ("jax_ep", "baseline")]
    for mode, metric, ylabel in (("normal", "gbps", "GB/s (bytes of received rows / time)"),
                                 ("low_latency", "us", "time per call (us)")):
        rows = [r for r in ok if r["mode"] == mode]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        for name in dict.fromkeys((r["name"], r["op"]) for r in rows):
            pts = sorted((r["tokens"], r[metric]) for r in rows if (r["name"], r["op"]) == name)
            style = "-o" if any(r["kind"] == "jax_ep" for r in rows if r["name"] == name[0]) else "--x"
            label = name[0] if name[0].endswith(name[1].split()[0]) or name[1] in name[0] else f"{name[0]} ({name[1]})"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.set_xscale("log", base=2)
        if metric == "us":
            ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel(ylabel)
        ax.set_title(f"jax_ep vs JAX collectives, {mode.replace('_', '-')} mode\n{machine}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        path = os.path.join(out_dir, f"{mode}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
