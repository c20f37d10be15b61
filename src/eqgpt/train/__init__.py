"""Training: state, optimizer, the one compiled step, the loop, checkpoints, export."""

from eqgpt.parallel.placement import Placement, SingleDevice
from eqgpt.parallel.strategy import Strategy
from eqgpt.precision import Policy
from eqgpt.train.export import load_model, save_model
from eqgpt.train.optim import decay_mask, make_lr_schedule, make_optimizer
from eqgpt.train.state import TrainState
from eqgpt.train.step import accumulate, lower_from_shapes, make_train_step
from eqgpt.train.trainer import (
    History,
    Trainer,
    TrainerConfig,
    eval_batches,
    make_eval_fn,
    plot_history,
)

__all__ = [
    "TrainState", "Policy", "Strategy", "Placement", "SingleDevice", "make_optimizer", "make_lr_schedule",
    "decay_mask", "make_train_step", "lower_from_shapes", "accumulate", "Trainer", "TrainerConfig", "History",
    "make_eval_fn", "eval_batches", "plot_history", "save_model", "load_model",
]
