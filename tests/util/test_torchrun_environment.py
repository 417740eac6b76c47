"""torchrun's variables (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) without a group they can form:
one line from every command that forms one, naming the variable, exit 2, nothing written; and a group whose
other ranks never come ends with one line within the command's --dist-timeout, never a hang."""

import json
import time

import pytest
from helpers import assert_one_error, cli, distill_args, free_port, new_run_args, sample_args, tree_state
from hypothesis import given, settings
from hypothesis import strategies as st

from elflow.util.distributed import torchrun_env
from elflow.util.errors import ELFError

VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def torchrun_unset(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


values = st.one_of(st.none(), st.sampled_from(["0", "1", "2", "-1", "3", "65536", "29500", "abc", "", " 1 ",
                                               "1.5", "localhost", "nan"]), st.text(max_size=6))


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({name: values for name in VARIABLES}))
def test_any_torchrun_variables_are_read_or_refused_in_one_line(env):
    """Whatever torchrun's variables hold: one process (WORLD_SIZE unset or 1), a rank of a group with every
    value in its range, or one ELFError line naming the variable; never another exception."""
    env = {k: v for k, v in env.items() if v is not None}
    try:
        got = torchrun_env(env)
    except ELFError as e:
        line = str(e)
        assert "\n" not in line and any(name in line for name in VARIABLES), line
        return
    if got is not None:
        rank, world, local, addr, port = got
        assert world > 1 and 0 <= rank < world and 0 <= local < world and addr and 1 <= port <= 65535


# torchrun's variables as set without torchrun -> words of the line
BAD_ENVIRONMENTS = {
    "no-master-addr": (dict(LOCAL_RANK="0", RANK="0", WORLD_SIZE="2"), ["MASTER_ADDR is not set", "torchrun"]),
    "master-port-not-a-port": (dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="localhost",
                                    MASTER_PORT="notaport"), ["MASTER_PORT='notaport' is not a whole number"]),
    "no-rank": (dict(WORLD_SIZE="2", MASTER_ADDR="localhost", MASTER_PORT="29500"), ["RANK is not set"]),
    "rank-past-the-world": (dict(RANK="2", WORLD_SIZE="2", MASTER_ADDR="localhost", MASTER_PORT="29500"),
                            ["RANK='2' is not a whole number from 0 to 1"]),
    "world-size-a-word": (dict(WORLD_SIZE="two"), ["WORLD_SIZE='two' is not a whole number >= 1"]),
}


def command(name, tmp_path, run, t5, corpus, cache, judge):
    samples = tmp_path / "s.jsonl"
    samples.write_text("".join(json.dumps({"text": f"line {i} of a text"}) + "\n" for i in range(2)))
    return {"train": new_run_args(t5, corpus, cache, tmp_path / "new"),
            "sample": sample_args(run, tmp_path / "out.jsonl"),
            "eval": ["eval", samples, "--judge", judge, "--device", "cpu", "--no-heldout", "--report",
                     tmp_path / "report.json"],
            "distill": distill_args(run, tmp_path / "students", cache, "--batch", "8")}[name]


@pytest.mark.parametrize("case", sorted(BAD_ENVIRONMENTS))
@pytest.mark.parametrize("name", ["train", "sample", "eval", "distill"])
def test_torchrun_variables_without_torchrun_are_one_line(capsys, torchrun_unset, tmp_path, trained, tiny_t5_dir,
                                                          tiny_corpus_file, cache, tiny_t5_judge_dir, name, case):
    env, words = BAD_ENVIRONMENTS[case]
    argv = command(name, tmp_path, trained, tiny_t5_dir, tiny_corpus_file, cache, tiny_t5_judge_dir)
    before = tree_state(tmp_path)
    for k, v in env.items():
        torchrun_unset.setenv(k, v)
    code, _, err = cli(capsys, argv)
    assert_one_error(code, err, name, *words)
    assert tree_state(tmp_path) == before


@pytest.mark.parametrize("name, rank", [("train", "0"), ("sample", "0"), ("sample", "1"), ("eval", "1")])
def test_a_group_whose_peers_never_come_ends_within_the_timeout(capfd, torchrun_unset, tmp_path, trained,
                                                                tiny_t5_dir, tiny_corpus_file, cache,
                                                                tiny_t5_judge_dir, name, rank):
    """Rank 0 waits for a rank 1 that never starts, or rank 1 for a rank 0 that never starts: one line within
    --dist-timeout (3 s here; torch's own retry logs do not reach the terminal), nothing written."""
    argv = command(name, tmp_path, trained, tiny_t5_dir, tiny_corpus_file, cache, tiny_t5_judge_dir)
    before = tree_state(tmp_path)
    for k, v in dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        torchrun_unset.setenv(k, v)
    began = time.monotonic()
    code, _, err = cli(capfd, [*argv, "--dist-timeout", "0.05"])
    assert time.monotonic() - began < 60
    said = "rank 0 of WORLD_SIZE=2: the torchrun group did not form" if rank == "0" else \
        "rank 1 of WORLD_SIZE=2: nothing answered at MASTER_ADDR=127.0.0.1"
    assert_one_error(code, err, name, said, "within --dist-timeout 0.05 minutes", "every rank must start")
    assert tree_state(tmp_path) == before


def test_rank_0_on_a_port_another_program_holds_is_one_line(capsys, torchrun_unset, tmp_path, trained):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
            torchrun_unset.setenv(k, v)
        code, _, err = cli(capsys, [*sample_args(trained, tmp_path / "s.jsonl"), "--dist-timeout", "0.05"])
    assert_one_error(code, err, "sample", f"another program holds port {port} on this host", "--master-port")
    assert not (tmp_path / "s.jsonl").exists()


@pytest.mark.parametrize("flag_value", ["0", "-1", "nan", "inf", "1e12"])
@pytest.mark.parametrize("name", ["sample", "eval"])
def test_sample_and_eval_take_a_dist_timeout_in_range(capsys, tmp_path, trained, tiny_t5_dir, tiny_corpus_file,
                                                      cache, tiny_t5_judge_dir, name, flag_value):
    argv = command(name, tmp_path, trained, tiny_t5_dir, tiny_corpus_file, cache, tiny_t5_judge_dir)
    code, _, err = cli(capsys, [*argv, "--dist-timeout", flag_value])
    assert_one_error(code, err, name, "--dist-timeout must be a number of minutes")


def test_sigterm_stops_a_rank_0_that_waits_for_its_peers(tmp_path, trained):
    """A rendezvous waits inside torch's C++ code: SIGTERM ends the wait at once (not when --dist-timeout, here
    10 minutes, runs out), with the one line of a stopped command, and nothing written."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    port = free_port()
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    argv = [sys.executable, "-m", "elflow.cli", *map(str, sample_args(trained, tmp_path / "s.jsonl")),
            "--dist-timeout", "10"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:  # until rank 0's rendezvous listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("elflow sample: stopped by SIGTERM"), err
    assert not (tmp_path / "s.jsonl").exists()
