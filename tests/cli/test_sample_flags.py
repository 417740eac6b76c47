"""`elflow sample --help` states the defaults that run for each kind of model, and sampling flags out of
range are refused before the model loads (sample and eval)."""

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
