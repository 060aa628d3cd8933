"""Curves of any train.py runs on one figure, read from their TensorBoard event files.

    python -m experiments.plot runs/a_seed0 runs/a_seed1 runs/b_seed0 --metric charts/reward_mean
    python -m experiments.plot runs/* --metric charts/reward_mean charts/completion_len --out curves.png

Runs whose folder names differ only in a trailing seed (`NAME_seed3`, `NAME-seed3`, `NAME_s3` or
`NAME-s3`; `NAME3` is not one) form one arm: its curve is the mean over the seeds at each step,
with a band of ± one standard deviation (Bessel; no band for one seed). Steps that not every seed
of the arm logged are left out of its curve. One panel per metric; an arm keeps its colour in all.
"""

import argparse
import os
import re
from collections import defaultdict

import numpy as np

SEED = re.compile(r"^(?P<arm>.+?)[_-](?:seed|s)(?P<seed>\d+)$")


def arm_of(run_dir):
    """The arm a run belongs to: its folder name without a trailing _seedN, -seedN, _sN or -sN."""
    name = os.path.basename(os.path.normpath(run_dir))
    match = SEED.match(name)
    return match.group("arm") if match else name


def read_scalars(run_dir, metrics, strict=True):
    """{metric: {step: value}} from the event files under run_dir (its tb/ folder, or itself); when a
    step was logged twice (a resumed run), the last value is the one kept. A metric the run did not
    log is an error, or with strict=False left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = os.path.join(run_dir, "tb") if os.path.isdir(os.path.join(run_dir, "tb")) else run_dir
    events = EventAccumulator(folder, size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags().get("scalars", []))
    missing = [m for m in metrics if m not in tags]
    if missing and strict:
        raise SystemExit(f"{run_dir}: no scalar {', '.join(missing)} in its event files "
                         f"(it has {len(tags)} scalars, e.g. {', '.join(sorted(tags)[:5])})")
    out = {}
    for metric in (m for m in metrics if m in tags):
        values = {}
        for event in sorted(events.Scalars(metric), key=lambda e: e.wall_time):
            values[event.step] = event.value
        out[metric] = values
    return out


def mean_and_std(curves):
    """Steps logged by every curve, the mean and the Bessel std there (0 for one curve).
    curves: [{step: value}] -> (steps [S], mean [S], std [S])"""
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    values = np.array([[c[s] for s in steps] for c in curves], dtype=np.float64)     # [runs, S]
    std = values.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros(len(steps))
    return np.array(steps), values.mean(axis=0), std


def arms(run_dirs, metrics, strict=True):
    """{arm: {metric: (steps, mean, std)}}, arms in the order their first run was given; with
    strict=False an arm whose runs did not all log a metric has no curve of it."""
    runs = defaultdict(list)
    for run_dir in run_dirs:
        runs[arm_of(run_dir)].append(read_scalars(run_dir, metrics, strict))
    return {arm: {m: mean_and_std([r[m] for r in rs]) for m in metrics if all(m in r for r in rs)}
            for arm, rs in runs.items()}


def plot(curves, metrics, out, title=None, samples=None):
    """One panel per metric, one line (mean) and band (± std) per arm; saved as `out` (PNG). With
    `samples` ({arm: {step: samples seen by then}}), a second row draws the same curves against the
    samples, for arms that differ in samples per iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if samples else 1
    fig, axes = plt.subplots(rows, len(metrics), figsize=(4.5 * len(metrics), 3.4 * rows), squeeze=False)
    colors = {arm: f"C{k % 10}" for k, arm in enumerate(curves)}
    for row in range(rows):
        for ax, metric in zip(axes[row], metrics):
            for arm, by_metric in curves.items():
                if metric not in by_metric:
                    continue
                steps, mean, std = by_metric[metric]
                x = np.array([samples[arm][s] for s in steps]) if row else steps
                ax.plot(x, mean, label=arm, color=colors[arm])
                ax.fill_between(x, mean - std, mean + std, color=colors[arm], alpha=0.2, linewidth=0)
            ax.set_xlabel("samples (completions)" if row else "iteration")
            ax.set_title(metric, fontsize=10)
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[arm], label=arm) for arm in curves]
    axes[0][0].legend(handles=handles, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run folders (train.py --run-dir) or TensorBoard folders")
    p.add_argument("--metric", nargs="+", required=True, help="scalar names, e.g. charts/reward_mean")
    p.add_argument("--out", default="curves.png", help="the PNG to write (default curves.png)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    curves = arms(args.runs, args.metric)
    plot(curves, args.metric, args.out, args.title)
    print(f"{len(args.runs)} runs in {len(curves)} arms ({', '.join(curves)}); wrote {args.out}")


if __name__ == "__main__":
    main()
