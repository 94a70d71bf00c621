"""The report's charts keep their legends readable (#39 item 11): beside the plot, inside the
figure, over neither the curves nor the title, however many series a chart has."""

from __future__ import annotations

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from coevo.observe.report import chart_figure
from coevo.observe.series import Series


def _series(names: list[tuple[str, tuple[tuple[str, str], ...]]]) -> list[Series]:
    out = []
    for i, (name, labels) in enumerate(names):
        s = Series(name, labels)
        for t in range(40):
            s.append(t * 6.0, (i + 1) * 0.05 + 0.001 * t)
        out.append(s)
    return out


SLOTS = [("task_difficulty", (("slot", f"slot-{i}"),)) for i in range(8)]
CONSUMERS = [
    (name, (("consumer", f"{role}-agent-consumer"),))
    for role in ("scorer", "judge", "learner", "policy", "tasks", "metrics")
    for name in ("consumer_pending", "consumer_ack_pending")
]


@pytest.mark.parametrize(("chart", "names"), [("difficulty", SLOTS), ("consumers", CONSUMERS)])
def test_the_legend_is_beside_the_plot_and_inside_the_figure(chart: str, names: list) -> None:
    fig = chart_figure(chart, _series(names))
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent(renderer)
    page = fig.bbox
    assert page.x0 <= legend.x0 and legend.x1 <= page.x1 and page.y0 <= legend.y0 and legend.y1 <= page.y1
    assert not legend.overlaps(ax.get_window_extent(renderer))  # the curves stay visible
    assert not legend.overlaps(ax.title.get_window_extent(renderer))
    assert len(ax.get_legend().get_texts()) == len(names)  # every series named
