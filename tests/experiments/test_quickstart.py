"""`elflow quickstart`: over an existing run it refuses before saying it trains, and its report says how far
a stopped run trained."""
import json

from elflow.cli import main


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
