"""The command line documented in README.md: ``python -m gptlab {fetch,train,sample,bench} --help``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gptlab.__main__ import build_parser, main

COMMANDS = ["fetch", "train", "sample", "bench"]
BENCHMARKS = ["train", "generate", "speculative"]


def _help(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 0, f"`python -m gptlab {' '.join(argv)}` exited {exc.value.code}: {err}"
    return out


def test_module_entry_point_help():
    """The real entry point, in a fresh interpreter, lists every documented command."""
    r = subprocess.run([sys.executable, "-m", "gptlab", "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "usage: python -m gptlab" in r.stdout
    for name in COMMANDS:
        assert name in r.stdout, f"`python -m gptlab --help` does not list the {name!r} command:\n{r.stdout}"


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command: str, capsys):
    subparsers = build_parser()._subparsers._group_actions[0].choices
    assert command in subparsers, (
        f"`python -m gptlab {command}` is not registered (commands found: {sorted(subparsers)}); "
        "gptlab/cli.py must add it"
    )
    out = _help([command, "--help"], capsys)
    assert f"usage: python -m gptlab {command}" in out


@pytest.mark.parametrize("bench", BENCHMARKS)
def test_bench_help(bench: str, capsys):
    out = _help(["bench", bench, "--help"], capsys)
    assert f"usage: python -m gptlab bench {bench}" in out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: python -m gptlab" in capsys.readouterr().out


def test_unknown_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_every_benchmark_module_is_a_command():
    """Each module of gptlab.bench is a `bench` subcommand (none silently missing), run by its run(args)."""
    import pkgutil

    import gptlab.bench as bench
    import gptlab.cli as cli

    modules = {m.name for m in pkgutil.iter_modules(bench.__path__)}
    alias = {"class": "grading_class"}  # `bench class`: a module cannot be named after a keyword
    assert {alias.get(n, n) for n in cli._BENCHMARKS} == modules
    for name, (module, _arguments) in cli._BENCHMARKS.items():
        assert module.__name__ == f"gptlab.bench.{alias.get(name, name)}" and callable(module.run)


def test_bench_help_lists_every_benchmark(capsys):
    import gptlab.cli as cli

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in cli._BENCHMARKS:
        assert name in out


def test_bench_train_into_a_run_folder_is_one_line(tmp_path, capsys):
    """`bench train --out DIR` where DIR holds a run: refused in one line (exit 2), the run kept."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    code = main(["bench", "train", "--recipe", "tiny", "--max-steps", "2", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "already holds a training run" in out + err and "Traceback" not in out + err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_bench_train_into_a_folder_a_live_run_holds_is_one_line_on_stderr(tmp_path, capsys):
    """`bench train --out DIR` while another live process holds DIR's lock: refused (exit 2) in one
    line on stderr with the prefix every command's errors have (it was printed on stdout, prefixed
    `gptlab bench train:`)."""
    import json
    import socket
    import subprocess
    import sys

    from gptlab.train import LOCK_FILE

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(), "since": "now"}))
        code = main(["bench", "train", "--recipe", "tiny", "--max-steps", "2", "--out", str(tmp_path)])
    finally:
        other.kill()
        other.wait()
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "error" not in out and "Traceback" not in out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("python -m gptlab bench train: error: "), err
    assert f"pid {other.pid}" in lines[0]
