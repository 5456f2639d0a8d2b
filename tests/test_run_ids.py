"""A chapter's figures come from the same execution as the tables printed beside them.

Some numbers a chapter prints depend on the machine: timings, and the losses of models the chapter
trains. Their cells are tagged ``nbval-ignore-output``, so the book's tests (tests/test_book.py)
never compare them with a fresh build, and a figure's image is compared only for its presence. A
stored figure could then come from another execution than the table next to it (one cell executed
again, an old picture pasted back), and contradict it without any test noticing: issue 33 found
chapter 8's speed-up figure showing the opposite of the speed-ups printed beside it.

So such a chapter marks both. Each table of machine-dependent numbers ends with a line
``[run RUN, table DIGEST]``: ``RUN`` is drawn afresh each time the chapter executes, and ``DIGEST``
is the first 8 hex digits of ``sha256(RUN + "\\n" + the table's text)``, the text being everything
the cell printed to stdout since its previous such line (or its start). Each figure drawn from such
tables is a PNG whose metadata hold ``gptlab-run`` (``RUN``) and ``gptlab-tables`` (the digests of
the tables it was drawn from, separated by spaces), and shows the same ids in its corner. Chapter 8
prints and shows them with its helpers ``print_table`` and ``show``.

This file reads the notebooks as stored (it executes nothing) and fails when a table's digest does
not match its text (edited by hand, or printed in another run), when a notebook's tables carry more
than one run id (cells executed in different runs), or when a figure after a notebook's first such
table carries no ids, another run's id, or the digest of a table the notebook does not print at or
before the figure's cell (its table was executed again after it was drawn). The checks are tried
first on small notebooks built here, each with one of those defects.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BOOK = sorted(p for p in (REPO / "book").glob("*.ipynb"))
# The chapters that must carry run ids, and how many of their figures at least must carry them.
REQUIRED = {"08_speculative_decoding.ipynb": 3}
ID_LINE = re.compile(r"^\[run ([0-9a-f]{4,}), table ([0-9a-f]{8})\]$", re.MULTILINE)


def digest(run: str, text: str) -> str:
    return hashlib.sha256(f"{run}\n{text}".encode()).hexdigest()[:8]


def png_text(data: bytes) -> dict[str, str]:
    """The text chunks (tEXt, and iTXt without compression) of a PNG file."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    out, i = {}, 8
    while i + 8 <= len(data):
        (n,), kind = struct.unpack(">I", data[i : i + 4]), data[i + 4 : i + 8]
        body = data[i + 8 : i + 8 + n]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            if rest[:1] == b"\0":  # not compressed: flag, method, language\0, translated key\0, text
                _, _, rest = rest[2:].partition(b"\0")
                _, _, value = rest.partition(b"\0")
                out[key.decode("latin-1")] = value.decode("utf-8")
        i += 12 + n
    return out


def tables_of(cell: dict) -> list[tuple[str, str, str]]:
    """(run, digest, text) for each ``[run ..., table ...]`` line the cell printed to stdout."""
    stdout = "".join("".join(o["text"]) for o in cell.get("outputs", [])
                     if o["output_type"] == "stream" and o.get("name") == "stdout")
    found, start = [], 0
    for m in ID_LINE.finditer(stdout):
        found.append((m.group(1), m.group(2), stdout[start : m.start()].removesuffix("\n")))
        start = m.end() + 1
    return found


def figures_of(cell: dict) -> list[dict[str, str]]:
    """The text metadata of each PNG the cell displayed."""
    return [png_text(base64.b64decode("".join(o["data"]["image/png"])))
            for o in cell.get("outputs", [])
            if o["output_type"] in ("display_data", "execute_result") and "image/png" in o.get("data", {})]


def problems(nb: dict) -> tuple[list[str], int]:
    """What is wrong with a notebook's run ids, and how many of its figures carry them."""
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    out, runs, seen, first, checked = [], set(), set(), None, 0
    for i, cell in enumerate(code):
        for run, d, text in tables_of(cell):
            runs.add(run)
            if digest(run, text) != d:
                out.append(f"code cell {i}: the table printed before [run {run}, table {d}] has digest "
                           f"{digest(run, text)}: its text was changed after it was printed, or the cell printed "
                           "something else before it")
            seen.add(d)
            first = i if first is None else first
        for meta in figures_of(cell):
            if "gptlab-run" not in meta and "gptlab-tables" not in meta:
                if first is not None:
                    out.append(f"code cell {i}: a figure after the first table with a run id (code cell {first}) "
                               "carries no run id: draw it with the chapter's show(fig, table, ...)")
                continue
            checked += 1
            run, named = meta.get("gptlab-run", ""), meta.get("gptlab-tables", "").split()
            if runs and run not in runs:
                out.append(f"code cell {i}: a figure from run {run!r}, while the tables before it were printed "
                           f"in run {sorted(runs)}: the figure comes from another execution")
            if not named:
                out.append(f"code cell {i}: a figure names no table it was drawn from")
            for d in named:
                if d not in seen:
                    out.append(f"code cell {i}: a figure drawn from table {d}, which the notebook does not print at "
                               "or before this cell: that table was printed again (or by another run) after the "
                               "figure was drawn")
    if len(runs) > 1:
        out.append(f"the tables carry {len(runs)} run ids {sorted(runs)}: their cells were executed in different "
                   "runs; execute the whole chapter")
    return out, checked


# ---------------------------------------------------------------------------------------------
# the book as stored


@pytest.mark.parametrize("notebook", BOOK, ids=[p.name for p in BOOK])
def test_figures_and_tables_come_from_one_run(notebook: Path):
    found, checked = problems(json.loads(notebook.read_text()))
    assert not found, f"{notebook.relative_to(REPO)}:\n" + "\n".join(found)
    want = REQUIRED.get(notebook.name, 0)
    assert checked >= want, (f"{notebook.relative_to(REPO)}: {checked} figure(s) carry run ids, at least {want} "
                             "must (the figures drawn from its machine-dependent tables)")


def test_the_required_chapters_exist():
    assert set(REQUIRED) <= {p.name for p in BOOK}


# ---------------------------------------------------------------------------------------------
# the checks, on small notebooks with one defect each


def _png(meta: dict[str, str] | None) -> str:
    """A 1 x 1 grey PNG with these text chunks, base64 as a notebook stores it."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    body = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
    for k, v in (meta or {}).items():
        body += chunk(b"tEXt", k.encode("latin-1") + b"\0" + v.encode("latin-1"))
    body += chunk(b"IDAT", zlib.compress(b"\0\x80")) + chunk(b"IEND", b"")
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + body).decode()


def _table(run: str, text: str) -> dict:
    return {"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": [f"{text}\n[run {run}, table {digest(run, text)}]\n"]}]}


def _figure(meta: dict[str, str] | None) -> dict:
    return {"cell_type": "code", "outputs": [
        {"output_type": "display_data", "data": {"image/png": _png(meta), "text/plain": ["<Image>"]}}]}


def _nb(*cells: dict) -> dict:
    return {"cells": [{"cell_type": "code", "outputs": []}, *cells]}


TIMES = "g=1: 1.10x\ng=2: 1.25x"
GOOD = (_table("ab12cd", TIMES), _figure({"gptlab-run": "ab12cd", "gptlab-tables": digest("ab12cd", TIMES)}))


def test_png_text_reads_what_matplotlib_writes():
    plt = pytest.importorskip("matplotlib.pyplot")
    import io

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"gptlab-run": "ab12cd", "gptlab-tables": "0123abcd 4567ef01"})
    plt.close(fig)
    meta = png_text(buf.getvalue())
    assert meta["gptlab-run"] == "ab12cd" and meta["gptlab-tables"] == "0123abcd 4567ef01"
    assert png_text(base64.b64decode(_png({"a": "b"}))) == {"a": "b"}


def test_a_table_and_its_figure_from_one_run_pass():
    assert problems(_nb(*GOOD)) == ([], 1)
    # two tables printed by one cell, a figure drawn from both
    other = "alpha = 0.8"
    two = {"cell_type": "code", "outputs": [{"output_type": "stream", "name": "stdout", "text": [
        f"{TIMES}\n[run ab12cd, table {digest('ab12cd', TIMES)}]\n",
        f"{other}\n[run ab12cd, table {digest('ab12cd', other)}]\n"]}]}
    fig = _figure({"gptlab-run": "ab12cd", "gptlab-tables": f"{digest('ab12cd', TIMES)} {digest('ab12cd', other)}"})
    assert problems(_nb(two, fig)) == ([], 1)


def test_a_figure_from_an_old_run_fails():
    old = _figure({"gptlab-run": "999999", "gptlab-tables": digest("999999", TIMES)})
    found, _ = problems(_nb(GOOD[0], old))
    assert any("another execution" in p for p in found) and any("does not print" in p for p in found)


def test_a_table_executed_again_after_its_figure_fails():
    again = _table("ab12cd", "g=1: 0.97x\ng=2: 1.31x")  # same kernel, same run id, new numbers
    found, _ = problems(_nb(again, GOOD[1]))
    assert len(found) == 1 and "does not print" in found[0]


def test_a_table_edited_by_hand_fails():
    edited = json.loads(json.dumps(GOOD[0]))
    edited["outputs"][0]["text"] = [edited["outputs"][0]["text"][0].replace("1.10x", "1.30x")]
    found, _ = problems(_nb(edited, GOOD[1]))
    assert len(found) == 1 and "its text was changed" in found[0]


def test_tables_from_two_runs_fail():
    later = _table("ffee00", "alpha = 0.8")
    found, _ = problems(_nb(*GOOD, later))
    assert len(found) == 1 and "2 run ids" in found[0]


def test_a_figure_without_ids_after_a_table_fails_and_before_it_passes():
    found, _ = problems(_nb(*GOOD, _figure(None)))
    assert len(found) == 1 and "carries no run id" in found[0]
    assert problems(_nb(_figure(None), *GOOD)) == ([], 1)  # a seeded figure before any such table
