"""Ordinary mistakes on the command line are one line on stderr, no traceback, exit status 2
(issue 22); help texts state each default once; a command without its subcommand prints its own
usage."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gptlab import GPT, GPTConfig
from gptlab.__main__ import main
from gptlab.generation import generate
from gptlab.tokenizers import CharTokenizer

TEXT = "abcdefgh ijklmnop\nqrstuvwxyz"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict:
    """A target (block size 64) and a draft (block size 24) with the same character tokenizer."""
    from gptlab.train import checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    target = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    draft = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=24, n_layer=1, n_head=2, n_embd=16)).eval()
    checkpoint.save_checkpoint(root / "t", target, tokenizer=tok)
    checkpoint.save_checkpoint(root / "d", draft, tokenizer=tok)
    return {"root": root, "t": str(root / "t"), "d": str(root / "d"), "tok": tok, "target": target}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--top-p", "0"], r"--top-p must be in (0, 1], got 0.0"),
        (["--top-p", "nan"], r"--top-p must be a finite number, got nan"),
        (["--temperature", "-1"], r"--temperature must be >= 0 (0 = greedy), got -1.0"),
        (["--temperature", "inf"], r"--temperature must be a finite number, got inf"),
        (["--top-k", "0"], r"--top-k must be >= 1, got 0"),
        (["--repetition-penalty", "0"], r"--repetition-penalty must be > 0, got 0.0"),
        (["--max-new-tokens", "-5"], r"--max-new-tokens must be >= 0, got -5"),
        (["--num-samples", "0"], r"--num-samples must be >= 1, got 0"),
        (["--prompt", "ABC"], r"--prompt: character 'A' (U+0041) at position 0 is not in the tokenizer's vocabulary"),
        (["--prompt", ""], r"--prompt encodes to no tokens"),
        (["--device", "tpu"], r"--device: unknown device 'tpu'; expected one of 'auto', 'cpu'"),
    ],
)
def test_sample_usage_errors_are_one_line_exit_2(ckpts, capsys, extra, message):
    rc, out, err = _run(["sample", "--ckpt", ckpts["t"], "--device", "cpu", *extra], capsys)
    assert rc == 2
    line = _one_line_error(err)
    assert line.startswith("python -m gptlab sample: error: ")
    assert message in line


def test_sample_missing_checkpoint(tmp_path, capsys):
    rc, _, err = _run(["sample", "--ckpt", str(tmp_path / "nowhere")], capsys)
    assert rc == 2
    line = _one_line_error(err)
    assert "--ckpt: no gptlab checkpoint at" in line and "nowhere" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_sample_device_cuda_without_cuda(ckpts, capsys):
    rc, _, err = _run(["sample", "--ckpt", ckpts["t"], "--device", "cuda"], capsys)
    assert rc == 2
    assert "--device: device 'cuda' requested but CUDA is not available here" in _one_line_error(err)


def test_sample_unreadable_checkpoint_is_one_line_exit_1(ckpts, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpts["t"], bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    rc, _, err = _run(["sample", "--ckpt", str(bad), "--device", "cpu"], capsys)
    assert rc == 1
    assert "cannot load the checkpoint" in _one_line_error(err)


def test_sample_draft_default_max_new_tokens_fits_the_smaller_block(ckpts, capsys):
    """The default 500 does not fit the draft's block size 24: it is clipped, with a note, and the
    output is the target's own greedy continuation of that length."""
    tok = ckpts["tok"]
    rc, out, err = _run(["sample", "--ckpt", ckpts["t"], "--draft", ckpts["d"], "--prompt", "abc",
                         "--temperature", "0", "--device", "cpu"], capsys)
    assert rc == 0, err
    assert "note: --max-new-tokens 21, what the block size 24 of --draft leaves after the 3-token prompt" in err
    expected = generate(ckpts["target"], torch.tensor([tok.encode("abc")]), 21, temperature=0)
    assert out.strip() == tok.decode(expected[0].tolist()).strip()


def test_sample_draft_block_verification_is_the_library_call(ckpts, capsys):
    """``sample --draft --verification block`` prints what ``speculative_generate(...,
    verification="block")`` draws with the same seed (and differs from token verification's draws
    here, so the option reaches the call)."""
    from gptlab.generation import speculative_generate
    from gptlab.train.checkpoint import load_model

    tok = ckpts["tok"]
    (target, _), (draft, _) = load_model(ckpts["t"]), load_model(ckpts["d"])
    texts = {}
    for rule in ("block", "token"):
        rc, out, err = _run(["sample", "--ckpt", ckpts["t"], "--draft", ckpts["d"], "--prompt", "abc", "--temperature", "1",
                             "--max-new-tokens", "21", "--num-draft-tokens", "6", "--verification", rule,
                             "--seed", "3", "--no-stream", "--device", "cpu"], capsys)
        assert rc == 0, err
        texts[rule] = out
    idx = torch.tensor([tok.encode("abc")])
    want, _ = speculative_generate(target, draft, idx, 21, num_draft_tokens=6, temperature=1.0,
                                   verification="block", generator=torch.Generator().manual_seed(3))
    assert tok.decode(want[0].tolist()).strip() in texts["block"]
    assert texts["block"] != texts["token"]
    rc, _, err = _run(["sample", "--ckpt", ckpts["t"], "--draft", ckpts["d"], "--verification", "tree"], capsys)
    assert rc == 2 and "--verification" in err


def test_sample_draft_explicit_max_new_tokens_too_large(ckpts, capsys):
    rc, _, err = _run(["sample", "--ckpt", ckpts["t"], "--draft", ckpts["d"], "--prompt", "abc",
                       "--max-new-tokens", "30", "--device", "cpu"], capsys)
    assert rc == 2
    assert "--max-new-tokens 30 is too many for --draft: the block size 24 of --draft leaves 21" in _one_line_error(err)


def test_sample_draft_with_another_vocabulary(ckpts, tmp_path, capsys):
    from gptlab.train import checkpoint

    other = GPT(GPTConfig(vocab_size=ckpts["tok"].vocab_size + 3, block_size=64, n_layer=1, n_head=2, n_embd=16))
    checkpoint.save_checkpoint(tmp_path / "o", other)
    rc, _, err = _run(["sample", "--ckpt", ckpts["t"], "--draft", str(tmp_path / "o"), "--prompt", "abc",
                       "--max-new-tokens", "5", "--device", "cpu"], capsys)
    assert rc == 2
    assert "--draft must share the vocabulary of --ckpt" in _one_line_error(err)


def test_sample_default_prompt_works_without_a_newline_in_the_vocabulary(tmp_path, capsys):
    from gptlab.train import checkpoint

    tok = CharTokenizer.from_text("abc")
    checkpoint.save_checkpoint(tmp_path / "c", GPT(GPTConfig(vocab_size=3, block_size=8, n_layer=1, n_head=2,
                                                             n_embd=16)), tokenizer=tok)
    rc, out, err = _run(["sample", "--ckpt", str(tmp_path / "c"), "--max-new-tokens", "4", "--device", "cpu"], capsys)
    assert rc == 0, err
    assert "note: the vocabulary has no newline; starting from token 0, 'a'" in err
    assert len(out.strip()) == 5


def test_sample_plain_default_max_new_tokens_is_500(ckpts, capsys):
    """Without --draft the context is cropped past the block size: the default 500 tokens work."""
    rc, out, err = _run(["sample", "--ckpt", ckpts["t"], "--prompt", "abc", "--device", "cpu", "--no-stream"],
                        capsys)
    assert rc == 0, err
    assert len(out.rstrip("\n")) == 3 + 500


# --------------------------------------------------------------------------- help texts


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_sample_help_states_each_default_once(capsys):
    out = " ".join(_help(["sample", "--help"], capsys).split())
    assert "(default: None)" not in out
    assert out.count("(default: a newline, or token 0 if the vocabulary has none)") == 1
    assert "--max-new-tokens N tokens to generate per sample (default: 500;" in out
    assert "(default: 0.8)" in out and "(default: 1337)" in out and "(default: 4)" in out


def test_bench_alone_prints_the_bench_usage(capsys):
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m gptlab bench")
    for name in ("train", "generate", "speculative", "autograde"):
        assert name in out


def test_sample_errors_from_a_real_process_have_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gptlab", "sample", "--ckpt", str(tmp_path / "nowhere")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["sample"], ["bench", "train"], ["bench", "generate"], ["bench", "speculative"],
                                  ["bench", "autograde"]])
def test_help_states_a_default_at_most_once_per_option(argv, capsys):
    """No ``(default: None)``, and no option whose help names its default twice."""
    import re

    out = _help([*argv, "--help"], capsys)
    assert "(default: None)" not in out
    options = re.split(r"\n  (?=-)", out.split("options:", 1)[1])
    for text in options:
        assert " ".join(text.split()).count("(default") <= 1, text


# --------------------------------------------------------------------------- issue 34: more rough edges

TRAIN = ["train", "--recipe", "tiny", "--max-steps", "2", "--no-progress", "--num-threads", "1"]


def test_train_out_empty_is_refused(tmp_path, monkeypatch, capsys):
    """``--out ""`` trained into the current folder without a word."""
    monkeypatch.chdir(tmp_path)
    rc, _, err = _run([*TRAIN, "--out", ""], capsys)
    assert rc == 2
    assert "gptlab train: error: the output folder (--out, out_dir) is an empty string" in _one_line_error(err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("under", [False, True], ids=["a-file", "under-a-file"])
def test_train_out_a_file_is_one_line(tmp_path, capsys, under):
    """``--out FILE`` (or ``FILE/run``) ended in a FileExistsError (NotADirectoryError) traceback."""
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    out = f / "run" if under else f
    rc, _, err = _run([*TRAIN, "--out", str(out)], capsys)
    assert rc == 2
    line = _one_line_error(err)
    assert line.startswith("gptlab train: error: the output folder ")
    assert (f"{f} is a file, not a folder" if under else f"{f} is a file; give a folder") in line
    assert f.read_text() == "mine"
    with pytest.raises(ValueError, match="is a file"):  # the library says the same
        from gptlab.train import get_recipe, train

        train(get_recipe("tiny", max_steps=2, progress=False), out)


@pytest.fixture
def course_dir(tmp_path):
    import shutil
    from pathlib import Path

    root = tmp_path / "course"
    root.mkdir()
    shutil.copy(Path(__file__).resolve().parent.parent / "nbgrader_config.py", root)
    return root


def test_course_grades_output_under_a_file(course_dir, tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("mine")
    rc, _, err = _run(["course", "grades", "--course", str(course_dir), "--output", str(f / "g.csv")], capsys)
    assert rc == 2
    assert f"--output {f / 'g.csv'}: {f} is a file, not a folder" in _one_line_error(err)
    assert f.read_text() == "mine"


@pytest.mark.parametrize("db, message", [
    ("{tmp}/missing/g.db", "the folder {tmp}/missing does not exist"),
    ("sqlite:///{tmp}/missing/g.db", "the folder {tmp}/missing does not exist"),
    ("nonsense://x", "SQLAlchemy knows no database kind 'nonsense'"),
    ("://x", "is neither a file path nor a database URL"),
    ("{tmp}", "is a folder; give the gradebook file in it"),
])
def test_course_grades_db_that_cannot_be_a_gradebook(course_dir, tmp_path, capsys, db, message):
    """``--db`` with a missing folder or a nonsense URL ended in SQLAlchemy tracebacks."""
    db, message = db.format(tmp=tmp_path), message.format(tmp=tmp_path)
    rc, _, err = _run(["course", "grades", "--course", str(course_dir), "--db", db,
                       "--output", str(tmp_path / "g.csv")], capsys)
    assert rc == 2
    line = _one_line_error(err)
    assert line.startswith("python -m gptlab course: error: --db ") and message in line, line
    assert not (tmp_path / "g.csv").exists()


@pytest.mark.parametrize("url", [False, True])
def test_course_grades_db_that_is_not_a_database(course_dir, tmp_path, capsys, url):
    """``--db`` naming a file that is no SQLite database (a typo'd CSV, notes) ended in
    SQLAlchemy's "file is not a database" traceback; the file is left as it was."""
    f = tmp_path / "grades.csv"
    f.write_text("student,total\nann,3\n")
    db = f"sqlite:///{f}" if url else str(f)
    rc, _, err = _run(["course", "grades", "--course", str(course_dir), "--db", db,
                       "--output", str(tmp_path / "g.csv")], capsys)
    assert rc == 2
    assert f"{f} is not an SQLite database" in _one_line_error(err)
    assert f.read_text() == "student,total\nann,3\n" and not (tmp_path / "g.csv").exists()


@pytest.mark.parametrize("config_line, message", [
    ("c.CourseDirectory.db_url = 'sqlite:///{tmp}/grades.csv'", "{tmp}/grades.csv is not an SQLite database"),
    ("c.CourseDirectory.db_url = 'sqlite:///{tmp}/missing/g.db'", "the folder {tmp}/missing does not exist"),
    ("c.CourseDirectory.db_url = 'nonsense://x'", "SQLAlchemy knows no database kind 'nonsense'"),
])
def test_course_grades_config_gradebook_that_cannot_be_one(course_dir, tmp_path, capsys, config_line, message):
    """A gradebook that nbgrader_config.py names (no --db) and that is no database, or sits in a
    missing folder, ended in SQLAlchemy's traceback: the same one line as --db, naming the config."""
    (tmp_path / "grades.csv").write_text("student,total\nann,3\n")
    with open(course_dir / "nbgrader_config.py", "a") as f:
        f.write("\n" + config_line.format(tmp=tmp_path) + "\n")
    rc, _, err = _run(["course", "grades", "--course", str(course_dir), "--output", str(tmp_path / "g.csv")], capsys)
    assert rc == 2
    line = _one_line_error(err)
    assert f"the gradebook of {course_dir / 'nbgrader_config.py'}" in line and message.format(tmp=tmp_path) in line, line
    assert (tmp_path / "grades.csv").read_text() == "student,total\nann,3\n"
    assert not (tmp_path / "g.csv").exists()


def test_course_grades_default_gradebook_that_is_not_a_database(course_dir, tmp_path, capsys):
    """No db_url anywhere: the course's gradebook.db; a file of another kind there is named too."""
    (course_dir / "gradebook.db").write_text("not a database")
    rc, _, err = _run(["course", "grades", "--course", str(course_dir), "--output", str(tmp_path / "g.csv")], capsys)
    assert rc == 2
    assert f"{course_dir / 'gradebook.db'} is not an SQLite database" in _one_line_error(err)


@pytest.mark.parametrize("timeout", ["0", "-5"])
def test_course_autograde_timeout_must_be_positive(course_dir, capsys, timeout):
    """``--timeout 0`` (or below) silently removed the per-cell time limit."""
    rc, _, err = _run(["course", "autograde", "--course", str(course_dir), "--timeout", timeout], capsys)
    assert rc == 2
    assert f"--timeout must be a positive number of seconds per cell, got {timeout}" in _one_line_error(err)


def test_fetch_an_unknown_asset_is_one_line_exit_2(capsys):
    rc, _, err = _run(["fetch", "nope"], capsys)
    assert rc == 2
    line = _one_line_error(err)
    assert line.startswith("python -m gptlab fetch: error: unknown asset(s) nope; available: ")


BENCH_MISTAKES = [
    ("train", ["--target-loss", "nan"], "--target-loss must be a positive number, got nan"),
    ("train", ["--target-loss", "-1"], "--target-loss must be a positive number, got -1.0"),
    ("train", ["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    ("train", ["--device", "tpu"], "--device: unknown device 'tpu'"),
    ("train", ["--num-threads", "0"], "--num-threads must be >= 1, got 0"),
    ("train", ["--peak-tflops", "0"], "--peak-tflops must be a positive number, got 0.0"),
    ("train", ["--json", "{dir}"], "--json {dir} is a folder; give a file path"),
    ("train", ["--out", "{file}"], "--out: the output folder {file} is a file"),
    ("train", ["--out", ""], "--out: the output folder (--out, out_dir) is an empty string"),
    ("generate", ["--new-tokens", "0"], "--new-tokens must be in [1, 255]"),
    ("generate", ["--rounds", "0"], "--rounds must be >= 1, got 0"),
    ("generate", ["--lengths", "8,x"], "--lengths must be comma-separated integers in [1, 255] (or empty), got '8,x'"),
    ("generate", ["--lengths", "8,300"], "--lengths must be comma-separated integers in [1, 255] (or empty), got '8,300'"),
    ("generate", ["--threads", "-1"], "--threads must be >= 1, got -1"),
    ("generate", ["--device", "nonsense"], "--device: unknown device 'nonsense'"),
    ("generate", ["--n-embd", "7"], "--n-embd 7: "),
    ("generate", ["--n-embd", "0"], "--n-embd 0: "),
    ("generate", ["--plot", "{file}/sweep.png"], "--plot {file}/sweep.png: {file} is a file, not a folder"),
    ("speculative", ["--models", "{file}"], "--models {file}: {file} is a file, not a folder"),
    ("speculative", ["--gs", "1,x"], "--gs must be comma-separated integers >= 1, got '1,x'"),
    ("speculative", ["--gs", "0,2"], "--gs must be comma-separated integers >= 1, got '0,2'"),
    ("speculative", ["--gs", ""], "--gs must be comma-separated integers >= 1, got ''"),
    ("speculative", ["--new-tokens", "200"], "--new-tokens must be in [1, 112]"),
    ("speculative", ["--prompts", "0"], "--prompts must be >= 1, got 0"),
    ("speculative", ["--rounds", "0"], "--rounds must be >= 1, got 0"),
    ("speculative", ["--temperatures", "0,hot"], "--temperatures must be comma-separated numbers >= 0, got '0,hot'"),
    ("speculative", ["--temperatures", "-1"], "--temperatures must be comma-separated numbers >= 0, got '-1'"),
    ("speculative", ["--temperatures", "nan"], "--temperatures must be comma-separated numbers >= 0, got 'nan'"),
    ("speculative", ["--verification", "tree"], "--verification must be 'block', 'token' or both comma-separated, got 'tree'"),
    ("speculative", ["--verification", "block,"], "--verification must be 'block', 'token' or both comma-separated, got 'block,'"),
    ("speculative", ["--threads", "0"], "--threads must be >= 1, got 0"),
    ("speculative", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("speculative", ["--device", "tpu"], "--device: unknown device 'tpu'"),
    ("speculative", ["--json", "{dir}"], "--json {dir} is a folder"),
    ("autograde", ["--course", "{dir}"], "--course {dir}: not a course folder"),
    ("autograde", ["--students", "-1"], "--students must be >= 0, got -1"),
    ("autograde", ["--class-assignments", "causal_mask,nope"], "--class-assignments: unknown assignment(s) nope"),
    ("autograde", ["--workers", "1,x"], "--workers must be comma-separated integers >= 1, got '1,x'"),
    ("autograde", ["--workers", "0"], "--workers must be comma-separated integers >= 1, got '0'"),
    ("autograde", ["--blank-every", "-1"], "--blank-every must be >= 0, got -1"),
    ("autograde", ["--timeout", "0"], "--timeout must be >= 1, got 0"),
    ("autograde", ["--json", "{file}/b.json"], "--json {file}/b.json: {file} is a file, not a folder"),
]


@pytest.mark.parametrize("bench, extra, message", BENCH_MISTAKES,
                         ids=[f"{b}{'-'.join(e)}" for b, e, _ in BENCH_MISTAKES])
def test_bench_options_are_checked_before_it_runs(tmp_path, monkeypatch, capsys, bench, extra, message):
    """Every bench option is checked up front: a nonsense value is one line and exit 2 before
    anything runs (some were tracebacks, some accepted and used, or failing at the end of a run)."""
    import gptlab.cli as cli

    for module, _ in cli._BENCHMARKS.values():
        monkeypatch.setattr(module, "run", lambda args: pytest.fail("the benchmark ran"))
    f = tmp_path / "a-file"
    f.write_text("mine")
    fill = {"file": str(f), "dir": str(tmp_path)}
    extra = [a.format(**fill) for a in extra]
    rc, _, err = _run(["bench", bench, *extra], capsys)
    assert rc == 2, err
    line = _one_line_error(err)
    assert line.startswith(f"python -m gptlab bench {bench}: error: ") and message.format(**fill) in line, line
    assert f.read_text() == "mine"


def test_every_benchmark_has_its_options_checked(monkeypatch, capsys):
    import gptlab.cli as cli

    assert set(cli._BENCH_CHECKS) == set(cli._BENCHMARKS)
    ran = []
    for name, (module, _) in cli._BENCHMARKS.items():
        monkeypatch.setattr(module, "run", lambda args, name=name: ran.append(name) or 0)
    for name in cli._BENCHMARKS:  # the defaults pass
        assert main(["bench", name]) == 0, capsys.readouterr().err
    assert ran == list(cli._BENCHMARKS)


STOP_AT_IMPORT = r"""
import os, sys
class _Stop:  # Ctrl-C at the moment STOP_AT is imported
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["STOP_AT"]:
            sys.meta_path.remove(self)
            raise KeyboardInterrupt
sys.meta_path.insert(0, _Stop())
"""


@pytest.mark.parametrize("stop_at", ["torch", "gptlab.course"], ids=["importing-gptlab", "importing-the-cli"])
def test_ctrl_c_while_train_imports_is_one_line(tmp_path, stop_at):
    """Ctrl-C in the first second of ``python -m gptlab train`` (torch being imported, by the
    package or by the command line's modules) printed a KeyboardInterrupt traceback."""
    import os
    import signal

    (tmp_path / "sitecustomize.py").write_text(STOP_AT_IMPORT)
    env = {**os.environ, "STOP_AT": stop_at,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "gptlab", "train", "--recipe", "tiny", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode in (130, -signal.SIGINT)  # the shell's $? is 130 either way
    assert r.stderr.strip() == "gptlab train: interrupted before training started; nothing was written", r.stderr
    assert not (tmp_path / "run").exists()
