"""``course collect``: a notebook saved under a copy's name is taken for the assignment's notebook.

Colab saves ``Copy of causal_mask.ipynb``, a browser's second download is ``causal_mask (1).ipynb``
or ``causal_mask(2).ipynb``, JupyterLab's duplicate ``causal_mask-Copy1.ipynb``. In a learner's
folder (``<student>/`` or nbgrader's exchange) such a file is collected as ``causal_mask.ipynb``
with a one-line message; the exact name wins over a copy, and the message names the copy left
aside. A flat folder's file named after the notebook names no student: it is skipped.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gptlab.__main__ import main
from gptlab.course import Course
from gptlab.course.collect import collect, copy_of

REPO = Path(__file__).resolve().parent.parent
NAME = "causal_mask"  # an assignment of one notebook, causal_mask.ipynb


def _nb_text(tag: str) -> str:
    import nbformat

    return nbformat.writes(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f"# {tag}")]))


@pytest.fixture
def course(tmp_path) -> Path:
    root = tmp_path / "course"
    root.mkdir()
    shutil.copy(REPO / "nbgrader_config.py", root)
    shutil.copytree(REPO / "solutions" / NAME, root / "solutions" / NAME,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    assert [p.name for p in (root / "solutions" / NAME).glob("*.ipynb")] == [f"{NAME}.ipynb"]
    return root


def _collected(course: Path, student: str) -> str:
    folder = course / "submitted" / student / NAME
    return (folder / f"{NAME}.ipynb").read_text()


def test_copy_names():
    for name in ["Copy of causal_mask.ipynb", "causal_mask (1).ipynb", "causal_mask(2).ipynb",
                 "causal_mask-Copy1.ipynb", "Copy of Copy of causal_mask (3).ipynb"]:
        assert copy_of(name, "causal_mask"), name
    for name in ["causal_mask.ipynb", "causal_mask_v2.ipynb", "Copy of attention.ipynb", "causal_mask (x).ipynb",
                 "causal_mask (1).ipynb.txt", "my causal_mask.ipynb"]:
        assert not copy_of(name, "causal_mask"), name


def test_student_folders_with_copies(course, tmp_path, capsys):
    inbox = tmp_path / "inbox"
    for student, files in {
        "alice": {f"Copy of {NAME}.ipynb": "alice-colab"},
        "bob": {f"{NAME} (1).ipynb": "bob-download", "data.csv": None},
        "cy": {f"{NAME}(2).ipynb": "cy-download"},
        "dee": {f"{NAME}.ipynb": "dee-exact", f"Copy of {NAME}.ipynb": "dee-copy"},
        "eve": {f"{NAME}.ipynb": "eve-exact"},
    }.items():
        (inbox / student).mkdir(parents=True)
        for fname, tag in files.items():
            (inbox / student / fname).write_text(_nb_text(tag) if tag else "1,2\n")
    assert main(["course", "collect", str(inbox), "--assignment", NAME, "--course", str(course)]) == 0
    out = capsys.readouterr().out
    assert f"alice: took 'Copy of {NAME}.ipynb' as {NAME}.ipynb" in out
    assert f"bob: took '{NAME} (1).ipynb' as {NAME}.ipynb" in out
    assert f"cy: took '{NAME}(2).ipynb' as {NAME}.ipynb" in out
    assert f"dee: took {NAME}.ipynb, ignored 'Copy of {NAME}.ipynb'" in out
    assert "eve:" not in out
    for student, tag in [("alice", "alice-colab"), ("bob", "bob-download"), ("cy", "cy-download"),
                         ("dee", "dee-exact"), ("eve", "eve-exact")]:
        assert f"# {tag}" in _collected(course, student), student
    sub = course / "submitted"
    assert not (sub / "alice" / NAME / f"Copy of {NAME}.ipynb").exists()  # renamed, not copied twice
    assert (sub / "bob" / NAME / "data.csv").is_file()
    assert (sub / "dee" / NAME / f"Copy of {NAME}.ipynb").is_file()  # kept, under its own name
    assert "5 submission(s) collected, 0 skipped" in out


def test_the_latest_of_several_copies_wins(course, tmp_path):
    inbox = tmp_path / "inbox"
    (inbox / "ann").mkdir(parents=True)
    old, new = inbox / "ann" / f"{NAME} (1).ipynb", inbox / "ann" / f"Copy of {NAME}.ipynb"
    old.write_text(_nb_text("old"))
    new.write_text(_nb_text("new"))
    os.utime(old, (1_700_000_000, 1_700_000_000))
    os.utime(new, (1_700_000_100, 1_700_000_100))
    got = collect(Course(course), inbox, NAME)
    assert got.messages == [f"ann: took 'Copy of {NAME}.ipynb' as {NAME}.ipynb, ignored '{NAME} (1).ipynb'"]
    assert "# new" in _collected(course, "ann")


def test_dry_run_says_it_without_copying(course, tmp_path):
    inbox = tmp_path / "inbox"
    (inbox / "ann").mkdir(parents=True)
    (inbox / "ann" / f"Copy of {NAME}.ipynb").write_text(_nb_text("ann"))
    got = collect(Course(course), inbox, NAME, dry_run=True)
    assert got.messages == [f"ann: took 'Copy of {NAME}.ipynb' as {NAME}.ipynb"]
    assert not (course / "submitted").exists()


def test_the_exchange_layout_with_copies(course, tmp_path, capsys):
    inbound = tmp_path / "exchange" / "gptlab" / "inbound"
    stamp = "2026-03-01 10:00:00.000000 UTC"
    for student, files in {"ann": {f"Copy of {NAME}.ipynb": "ann"},
                           "bob": {f"{NAME}.ipynb": "bob", f"{NAME} (1).ipynb": "bob-old"}}.items():
        d = inbound / f"{student}+{NAME}+{stamp}+Zx9"
        d.mkdir(parents=True)
        (d / "timestamp.txt").write_text(stamp)
        for fname, tag in files.items():
            (d / fname).write_text(_nb_text(tag))
    assert main(["course", "collect", str(tmp_path / "exchange"), "--course", str(course)]) == 0
    out = capsys.readouterr().out
    assert f"ann ({NAME}): took 'Copy of {NAME}.ipynb' as {NAME}.ipynb" in out
    assert f"bob ({NAME}): took {NAME}.ipynb, ignored '{NAME} (1).ipynb'" in out
    assert "# ann" in _collected(course, "ann") and "# bob" in _collected(course, "bob")
    assert (course / "submitted" / "ann" / NAME / "timestamp.txt").read_text() == stamp


def test_a_flat_file_named_after_the_notebook_is_skipped(course, tmp_path, capsys):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "ann.ipynb").write_text(_nb_text("ann"))
    (inbox / f"Copy of {NAME}.ipynb").write_text(_nb_text("whose?"))
    (inbox / f"{NAME}.ipynb").write_text(_nb_text("whose?"))
    assert main(["course", "collect", str(inbox), "--assignment", NAME, "--course", str(course)]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (course / "submitted").iterdir()) == ["ann"]
    assert f"Copy of {NAME}.ipynb: named after the notebook, not a student" in out
    assert "1 submission(s) collected, 2 skipped" in out


def test_two_files_giving_one_student_id_are_a_conflict(course, tmp_path, capsys):
    """``Frank Smith.ipynb`` and ``Frank_Smith.ipynb`` both sanitize to ``Frank_Smith``: neither
    silently replaces the other; both are named, nothing is collected for that id, the rest is."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "Frank Smith.ipynb").write_text(_nb_text("frank-1"))
    (inbox / "Frank_Smith.ipynb").write_text(_nb_text("frank-2"))
    (inbox / "ann.ipynb").write_text(_nb_text("ann"))
    assert main(["course", "collect", str(inbox), "--assignment", NAME, "--course", str(course)]) == 0
    out = capsys.readouterr().out
    conflict = "conflict: 'Frank Smith.ipynb', 'Frank_Smith.ipynb' give the same student id 'Frank_Smith'"
    assert out.count(conflict) == 2, out
    assert f"skipped {inbox / 'Frank Smith.ipynb'}: {conflict}" in out
    assert f"skipped {inbox / 'Frank_Smith.ipynb'}: {conflict}" in out
    assert sorted(p.name for p in (course / "submitted").iterdir()) == ["ann"]
    assert "1 submission(s) collected, 2 skipped" in out


def test_a_file_and_a_folder_of_one_student_are_a_conflict(course, tmp_path):
    inbox = tmp_path / "inbox"
    (inbox / "bob").mkdir(parents=True)
    (inbox / "bob" / f"{NAME}.ipynb").write_text(_nb_text("bob-folder"))
    (inbox / "bob.ipynb").write_text(_nb_text("bob-file"))
    got = collect(Course(course), inbox, NAME)
    assert got.copied == []
    assert sorted(Path(src).name for src, _ in got.skipped) == ["bob", "bob.ipynb"]
    assert all("give the same student id 'bob'" in why for _, why in got.skipped)


def test_exchange_names_that_sanitize_alike_are_a_conflict_but_resubmissions_are_not(course, tmp_path):
    inbound = tmp_path / "exchange" / "inbound"
    for student, stamp in [("ann", "2026-03-01 10:00:00.000000 UTC"), ("ann", "2026-03-02 10:00:00.000000 UTC"),
                           ("frank smith", "2026-03-01 10:00:00.000000 UTC"),
                           ("frank_smith", "2026-03-01 11:00:00.000000 UTC")]:
        d = inbound / f"{student}+{NAME}+{stamp}"
        d.mkdir(parents=True)
        (d / f"{NAME}.ipynb").write_text(_nb_text(f"{student} {stamp}"))
    got = collect(Course(course), tmp_path / "exchange")
    assert [(sid, Path(src).name) for sid, _, src in got.copied] == [("ann", f"ann+{NAME}+2026-03-02 10:00:00.000000 UTC")]
    reasons = {Path(src).name: why for src, why in got.skipped}
    assert reasons[f"ann+{NAME}+2026-03-01 10:00:00.000000 UTC"].startswith("a later submission of ann is collected")
    frank = [why for name, why in reasons.items() if name.startswith("frank")]
    assert len(frank) == 2 and all("give the same student id 'frank_smith'" in why for why in frank)


def test_a_learner_folder_without_the_notebook_gets_a_note(course, tmp_path):
    inbox = tmp_path / "inbox"
    (inbox / "cy" / "work").mkdir(parents=True)
    (inbox / "cy" / "my_attempt.ipynb").write_text(_nb_text("cy"))
    (inbox / "cy" / "notes.txt").write_text("hi")
    got = collect(Course(course), inbox, NAME)
    assert [sid for sid, _, _ in got.copied] == ["cy"]
    assert got.messages == [f"cy: no {NAME}.ipynb (nor a copy of it) in the folder, which holds 'my_attempt.ipynb', "
                            "'notes.txt', 'work/'; it is graded as missing unless renamed and collected again"]
