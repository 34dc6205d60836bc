"""Optional TTFT / ITL histograms (matplotlib is a dev extra, imported only when asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvmesh.services.cli.bench.client import RequestOutput


class PlotUnavailableError(RuntimeError):
    pass


def require_matplotlib() -> None:
    """Fail before a run, not after it, when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailableError(
            "--plot needs matplotlib: pip install 'kvmesh[dev]' (or matplotlib==3.11.2)"
        ) from exc


def write_latency_histograms(outputs: Sequence[RequestOutput], path: Path, title: str) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window or need a display
    import matplotlib.pyplot as plt

    done = [output for output in outputs if output.success]
    ttfts_ms = [output.ttft * 1000 for output in done]
    itls_ms = [gap * 1000 for output in done for gap in output.itl]
    figure, (ttft_axes, itl_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for axes, values, name in ((ttft_axes, ttfts_ms, "TTFT"), (itl_axes, itls_ms, "ITL")):
        axes.hist(values, bins=50)
        axes.set_xlabel(f"{name} (ms)")
        axes.set_ylabel("count")
        axes.set_title(f"{name}, {len(values)} samples")
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
