"""Training: state, optimizer, precision policy, the compiled step, placement, the loop."""

from eqgpt.train.export import load_model, save_model
from eqgpt.train.optim import decay_mask, make_optimizer, make_schedule
from eqgpt.train.placement import SingleDevice
from eqgpt.precision import Policy
from eqgpt.train.state import TrainState
from eqgpt.train.step import accumulate, all_finite, batch_loss, make_grad_fn, make_train_step
from eqgpt.train.trainer import History, Trainer, TrainerConfig, make_eval_fn, plot_history

__all__ = [
    "TrainState", "Policy", "make_optimizer", "make_schedule", "decay_mask", "make_train_step",
    "make_grad_fn", "accumulate", "all_finite", "batch_loss", "SingleDevice", "Trainer",
    "TrainerConfig", "History", "make_eval_fn", "plot_history", "save_model", "load_model",
]
