"""A ResNet trained on the digits set with the course's trainer, for accuracy against precision
(``digits_accuracy``): test accuracy evaluated under the training precision's autocast and with
autocast off, the last epoch's loss and the skipped steps, from a given seed. Lesson 04 compares
precisions, the selective-autocast model and Adam's settings with it.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from amp_lessons import models
from amp_lessons.data import TensorBatches, digits
from amp_lessons.measure.config import OPTIMIZERS, BenchConfig
from amp_lessons.measure.oom import free_memory
from amp_lessons.measure.steps import build_optimizer
from amp_lessons.measure.timer import wall_clock
from amp_lessons.numerics.precision import PRECISIONS, as_device, native_bf16
from amp_lessons.train import trainer as training
from amp_lessons.validate import check_choice, check_int

RESNET_DIGITS_MODELS = {"resnet50": models.resnet50, "resnet18": models.resnet18,
                        "resnet50-selective": models.optimized_resnet50,
                        "resnet18-selective": models.optimized_resnet18}


def digits_accuracy(model: str = "resnet18", precision: str = "fp32", device=None,
                    epochs: int = 6, batch_size: int = 64, image_size: int = 32,
                    small_input: bool = True, optimizer: str = "adam", lr: Optional[float] = None,
                    eps: float = 1e-8, amsgrad: bool = False, impl: str = "default",
                    max_train: Optional[int] = None, max_test: Optional[int] = None,
                    one_cycle: bool = True, seed: int = 0) -> Dict[str, object]:
    """Train a ResNet on the digits set with the shared trainer and report test accuracy.

    Adam (lr 1e-3) by default, with a one-cycle schedule so the last steps are small and the
    BatchNorm running statistics match the final weights. Accuracy is measured twice: under the
    training precision's autocast and with autocast off. ``max_train`` /
    ``max_test`` keep only the first examples (the quick profile). Returns a row with
    ``accuracy``, ``accuracy_fp32_eval`` (fractions), ``final_loss`` (mean training loss of the
    last epoch), ``skipped_steps``, ``steps``, ``classes``, ``test_examples`` and ``seconds``;
    ``status`` is ``"skipped"`` where the device cannot run the precision. The same ``seed``
    gives the same initial weights and batches."""
    check_choice("model", model, tuple(RESNET_DIGITS_MODELS))
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_int("epochs", epochs, 1)
    check_int("batch_size", batch_size, 1)
    for name, value in (("max_train", max_train), ("max_test", max_test)):
        if value is not None:
            check_int(name, value, 1)
    device = as_device(device)
    label = f"{model}, {precision}, {optimizer}"
    if optimizer != "sgd":
        label += f" eps={eps:g}" + (" amsgrad" if amsgrad else "")
    row: Dict[str, object] = {"label": label, "model": model, "precision": precision,
                              "optimizer": optimizer, "eps": eps, "amsgrad": amsgrad,
                              "classes": 10, "status": "ok", "reason": ""}
    if precision == "bf16" and not native_bf16(device):
        row.update(status="skipped", reason="bf16 needs compute capability 8.0+ "
                                            "(torch would only emulate it)")
        return row
    torch.manual_seed(seed)
    net = RESNET_DIGITS_MODELS[model](num_classes=10, in_channels=1,
                                      small_input=small_input).to(device)
    opt = build_optimizer(BenchConfig(optimizer=optimizer, impl=impl, lr=lr, eps=eps,
                                      amsgrad=amsgrad), net.parameters())
    x_train, y_train = digits("train", image_size, device)
    x_test, y_test = digits("test", image_size, device)
    x_train, y_train = x_train[:max_train], y_train[:max_train]
    x_test, y_test = x_test[:max_test], y_test[:max_test]
    # drop_last: a last batch of a few images would give BatchNorm noisy statistics
    train = TensorBatches(x_train, y_train, min(batch_size, len(x_train)), shuffle=True,
                          drop_last=True, seed=seed)
    test = TensorBatches(x_test, y_test, 256, shuffle=False)
    scheduler = None
    if one_cycle:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=opt.param_groups[0]["lr"], total_steps=epochs * len(train),
            pct_start=0.25)
    run = training.Trainer(net, opt, training.TrainConfig(precision=precision, progress=False,
                                                          seed=None),
                           device=device, scheduler=scheduler)
    with wall_clock() as clock:
        history = run.fit(train, epochs=epochs)
        same = run.evaluate(test)
        fp32 = run.evaluate(test, precision="fp32")
    losses = [r.loss for r in history]
    last = history.epochs[-1]["train_loss"] if getattr(history, "epochs", None) else None
    skipped = getattr(history, "skipped_steps", 0)
    row.update(accuracy=float(same["accuracy"]), accuracy_fp32_eval=float(fp32["accuracy"]),
               final_loss=float(last if last is not None else losses[-1]),
               skipped_steps=skipped if isinstance(skipped, int) else len(skipped or []),
               steps=len(losses), test_examples=int(same["examples"]),
               seconds=clock["seconds"])
    del run, net, opt, scheduler
    free_memory(device)
    return row


ACCURACY_COLUMNS = (("label", "run"), ("accuracy", "test acc (autocast)"),
                    ("accuracy_fp32_eval", "test acc (fp32 eval)"),
                    ("final_loss", "last epoch loss"), ("skipped_steps", "skipped"),
                    ("steps", "steps"), ("status", "status"))
