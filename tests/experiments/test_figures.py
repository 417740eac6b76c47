"""Figures a user reads: the schedules figure labels every axis and names the grids off their points; the
loss plot's log axis is labelled with round values."""
import json


def test_the_schedules_figure_labels_every_axis_and_names_the_grids_off_their_points():
    import matplotlib.pyplot as plt

    from elflow.experiments.schedules import schedules_figure

    fig = schedules_figure(n=2000)
    assert len(fig.axes) == 4
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
        assert len(ax.texts) == 0  # no label drawn among the data
    grids = fig.axes[3]
    assert [t.get_text() for t in grids.get_yticklabels()] == ["uniform, N=32", "N=8 (6 draws)", "N=32 (6 draws)"]
    assert grids.get_xlim()[1] <= 1.05  # nothing to the right of t = 1 but the axis
    plt.close(fig)


def test_the_loss_plots_log_axis_is_labelled_with_round_values(tmp_path):
    import matplotlib.pyplot as plt

    from elflow.runs.log import loss_figure, nice_ticks

    recs = [{"kind": "train", "step": s, "loss": 10 * 0.9 ** s, "loss_denoise": 1.5 + 0.1 * s}
            for s in range(1, 19)]  # losses from 9 down to 1.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fig = loss_figure(tmp_path)
    a = fig.axes[0]
    shown = [t.get_text() for t in a.get_yticklabels()]
    assert a.get_yscale() == "log" and shown == ["2", "3", "5", "7"], shown
    plt.close(fig)
    assert nice_ticks(1.5, 10) == [2, 5, 10]
    assert nice_ticks(1.1, 1.6) == [1.2, 1.4, 1.6] and nice_ticks(1.1, 2.37) == [1.2, 1.5, 2]
    assert nice_ticks(0.05, 0.09) == [0.05, 0.06, 0.07, 0.08, 0.09]
