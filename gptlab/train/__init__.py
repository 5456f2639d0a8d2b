"""Training: a model from batches by minimising the next-token loss (*logits -> loss -> update*).

``from gptlab.train import train, TrainConfig, get_recipe`` is the short way::

    summary = train(get_recipe("shakespeare-char-cpu"), "runs/cpu")   # python -m gptlab train ...

The package, in the order its modules import each other (ARCHITECTURE.md, "Logits to loss"):

* :mod:`~gptlab.train.config`: :class:`TrainConfig` (a run as data, its ``model`` a
  :class:`~gptlab.config.GPTConfig`) and the named :data:`RECIPES`;
* :mod:`~gptlab.train.schedule`: :func:`lr_at`, warmup then cosine decay;
* :mod:`~gptlab.train.rng`, :mod:`~gptlab.train.distributed`: the random streams a checkpoint
  keeps, and the processes under ``torchrun``;
* :mod:`~gptlab.train.signals`: Ctrl-C and SIGTERM stop a run at the end of a step, saved;
* :mod:`~gptlab.train.evaluation`, :mod:`~gptlab.train.metrics`: the validation loss, and the
  run's ``metrics.jsonl``, ``train_log.jsonl``, plot and summary;
* :mod:`~gptlab.train.checkpoint`, :mod:`~gptlab.train.run_folder`: checkpoints on disk, and the
  rules of a run's folder;
* :mod:`~gptlab.train.setup`: a run's data, device, optimiser, and a resume's checks;
* :mod:`~gptlab.train.distill`: the distillation loss (a draft model taught by a teacher);
* :mod:`~gptlab.train.loop`: :class:`Trainer` (set-up, step, evaluate, log) and :func:`train`;
* the command, ``python -m gptlab train``, is in :mod:`gptlab.cli` with every other command's.
"""

from ..files import LockError
from .config import DATASETS, RECIPES, TrainConfig, get_recipe
from .distill import distillation_loss
from .evaluation import val_windows
from .loop import Trainer, TrainingInterrupted, train
from .metrics import plot_metrics, read_metrics, read_train_log
from .run_folder import LOCK_FILE, RunFolderError, overwrite_backup
from .schedule import lr_at

__all__ = [
    "train",
    "Trainer",
    "TrainConfig",
    "RECIPES",
    "DATASETS",
    "get_recipe",
    "lr_at",
    "TrainingInterrupted",
    "RunFolderError",
    "LockError",
    "LOCK_FILE",
    "overwrite_backup",
    "distillation_loss",
    "val_windows",
    "plot_metrics",
    "read_metrics",
    "read_train_log",
]
