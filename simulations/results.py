"""Result files of a simulation run: ``results.json`` and accuracy/upload plots."""

from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plot_accuracy_vs_upload", "plot_runs", "write_results"]

_BYTES_PER_MB = 1e6  # decimal megabytes
_LOG_SPREAD = 100.0  # use a log x axis when max/min positive upload exceeds this


def _jsonable(value: Any) -> Any:
    """Map non-finite floats to ``None`` so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _default(value: Any) -> Any:
    """``json`` fallback: numpy scalars/arrays, paths, sets."""
    if hasattr(value, "tolist"):  # numpy scalar or array, torch tensor
        return _jsonable(value.tolist())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    raise TypeError(f"object of type {type(value).__name__} is not JSON serializable")


def write_results(
    out_dir: str | os.PathLike[str], config: dict, rounds: list[dict]
) -> pathlib.Path:
    """Write ``<out_dir>/results.json`` as ``{"config": ..., "rounds": ...}``.

    The directory is created if needed and the file is replaced atomically
    (written to a temporary file in the same directory, then ``os.replace``).
    NaN and infinities are written as ``null``; numpy values are converted.

    Parameters
    ----------
    out_dir : str or path-like
        Output directory.
    config : dict
        Run configuration.
    rounds : list of dict
        One record per round (e.g. ``round``, ``accuracy``, ``upload_bytes``).

    Returns
    -------
    pathlib.Path
        Path of the written ``results.json``.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    text = json.dumps(
        _jsonable({"config": config, "rounds": list(rounds)}),
        indent=2,
        default=_default,
        allow_nan=False,
    )
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".results.", suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _series(rounds: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    """Cumulative upload (MB) and accuracy (%) of the rounds that report accuracy."""
    xs: list[float] = []
    ys: list[float] = []
    cumulative = 0.0
    for record in rounds:
        cumulative += float(record.get("upload_bytes") or 0)
        acc = record.get("accuracy")
        if acc is None or not math.isfinite(float(acc)):
            continue
        xs.append(cumulative / _BYTES_PER_MB)
        ys.append(100.0 * float(acc))
    return xs, ys


def plot_runs(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | os.PathLike[str],
    *,
    title: str = "Accuracy vs. cumulative upload",
) -> pathlib.Path:
    """Plot accuracy against cumulative uploaded megabytes, one line per run.

    Each round record contributes ``upload_bytes`` (bytes uploaded by all
    clients that round; missing counts as 0) to the running total and, if it
    has a finite ``accuracy`` (a fraction in ``[0, 1]``), a point at
    ``(total MB, 100 * accuracy)``. The x axis is logarithmic when the positive
    totals span more than a factor of 100 (symmetric-log if some are 0).

    Parameters
    ----------
    runs : mapping of str to list of dict
        Run label -> round records.
    path : str or path-like
        PNG file to write (parent directories are created).
    title : str, default "Accuracy vs. cumulative upload"
        Figure title.

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    if not runs:
        raise ValueError("runs is empty: nothing to plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5), dpi=120)
    FigureCanvasAgg(fig)  # Agg without touching pyplot's global backend
    ax = fig.add_subplot()
    all_x: list[float] = []
    for label, rounds in runs.items():
        xs, ys = _series(rounds)
        all_x += xs
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=str(label))
    positive = [v for v in all_x if v > 0]
    if positive and max(positive) / min(positive) > _LOG_SPREAD:
        if len(positive) == len(all_x):
            ax.set_xscale("log")
        else:
            ax.set_xscale("symlog", linthresh=min(positive))
    ax.set_xlabel("Cumulative upload (MB)")
    ax.set_ylabel("Test accuracy (%)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if any(ax.get_lines()):
        ax.legend(loc="lower right")
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def plot_accuracy_vs_upload(
    rounds: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    label: str | None = None,
) -> pathlib.Path:
    """Plot one run's accuracy against cumulative upload; see :func:`plot_runs`.

    Parameters
    ----------
    rounds : list of dict
        Round records with ``accuracy`` and ``upload_bytes``.
    path : str or path-like
        PNG file to write.
    label : str or None, default None
        Legend label; ``"run"`` when ``None``.

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    return plot_runs({label if label is not None else "run": rounds}, path)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fedcomp.simulations.results OUT.png RUN_DIR_OR_JSON...``: one plot comparing runs."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out", help="PNG file to write")
    parser.add_argument("runs", nargs="+", help="results.json files or the directories holding them")
    args = parser.parse_args(argv)
    runs = {}
    for item in args.runs:
        path = pathlib.Path(item)
        path = path / "results.json" if path.is_dir() else path
        data = json.loads(path.read_text())
        runs[str(data["config"].get("upload", path.parent.name))] = data["rounds"]
    print(plot_runs(runs, args.out))


if __name__ == "__main__":
    main()
