"""What a new user meets on the command line: help that states the defaults that run, flags checked before
a model loads, what a stopped run and a refused start say, figures with labelled axes."""

import json

import pytest

from elflow.cli import main


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit):
        main([*args, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_sample_help_states_the_models_own_defaults_by_kind_of_model(capsys):
    from elflow.flow import SAMPLING_DEFAULTS

    text = _help(capsys, "sample")
    assert "default 32" not in text and "default sde" not in text and "default 3.0" not in text
    text_m, cond, few = (SAMPLING_DEFAULTS[k] for k in ("text", "conditional", "distilled"))
    assert (f"sampling steps N (default: the model's own: {text_m['steps']} for text models, {cond['steps']} for "
            "conditional ones, a distilled one's own step count") in text
    assert "(default: the model's own: sde for text models, ode for conditional ones, sde for distilled ones)" in text
    assert (f"self-conditioning guidance scale (default: the model's own: {text_m['omega']} for text models, "
            f"{cond['omega']} for conditional ones, {few['omega']} for distilled ones") in text
    # the prompt comes back as the tokenizer writes it
    assert "lowercased by an uncased one such as MiniLM's" in text


@pytest.mark.parametrize("flag, value, says", [("--steps", "0", "--steps must be an integer from 1 to 10,000 (the released recipe samples with at most 64 steps), got 0"),
                                               ("--gamma", "-1", "--gamma must be a number from 0 to 100"),
                                               ("--omega", "-0.5", "--omega must be a number from 0 to 100"),
                                               ("--batch", "0", "--batch must be an integer >= 1"),
                                               ("--top-p", "1.5", "--top-p must be a number in (0, 1]")])
def test_sampling_flags_out_of_range_are_refused_before_the_model_loads(flag, value, says, tmp_path, monkeypatch,
                                                                        capsys):
    import elflow.runs.load

    def never(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(elflow.runs.load, "load_for_sampling", never)
    monkeypatch.setattr("elflow.cli.sample.load_for_sampling", never)
    for command in (["sample", str(tmp_path / "no-run")], ["eval", "--checkpoint", str(tmp_path / "no-run")]):
        assert main([*command, flag, value, "--out", str(tmp_path / "s")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"elflow {command[0]}: error: {says}"), err


def test_quickstart_over_an_existing_run_refuses_before_saying_it_trains(tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "run.json").write_text("{}")
    for extra, says in (([], "already holds a run; pass --resume"),
                        (["--resume", "--out", str(tmp_path / "none")], "holds no run to resume")):
        assert main(["quickstart", "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert "training" not in err and err.count("\n") == 1 and says in err, err


def test_quickstart_report_says_how_far_a_stopped_run_trained(tmp_path, tiny_t5_dir, tiny_corpus_file):
    from helpers import tiny_config

    from elflow.experiments.quickstart import report, total_time
    from elflow.train import train

    run, cache = tmp_path / "run", tmp_path / "cache"
    train(tiny_config(tiny_t5_dir, tiny_corpus_file), run, cache_dir=cache, quiet=True, stop_after=3)
    lines = []
    out = report(run, sampler="vc", steps=2, num=2, cache_dir=cache, printer=lines.append)
    assert (out["steps_trained"], out["steps_planned"]) == (3, 6)
    stored = json.loads((run / "report.json").read_text())
    assert (stored["steps_trained"], stored["steps_planned"]) == (3, 6)
    assert any("trained 3 of 6 steps (stopped early: --resume continues it)" in line for line in lines)
    assert total_time("training", None, 90.0) == "total time 1.5 min (report only)"  # --report-only


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
