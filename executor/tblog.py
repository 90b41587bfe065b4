"""TensorBoard logs of a run (`tierflow run --log-dir DIR`): per step the training loss, learning rate,
gradient norm and tokens/s, and the validation loss and perplexity of each evaluation, as scalars a
TensorBoard (or any reader of its event files) shows. TensorBoard is optional (the `finetune` extra):
without it --log-dir is refused with one line."""

from __future__ import annotations

from tierflow.errors import TierflowError
from tierflow.extras import install_command


class LogDirError(TierflowError, ValueError):
    """--log-dir without TensorBoard installed, or a directory that cannot be written."""


class TbLog:
    """A SummaryWriter under `directory`; `close` flushes it."""

    def __init__(self, directory: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise LogDirError(f"--log-dir {directory}: TensorBoard is not installed (pip install "
                              f"tensorboard, or {install_command('finetune')}); or drop --log-dir: "
                              "steps.csv under --out has the same numbers") from None
        try:
            self.writer = SummaryWriter(log_dir=directory)
        except OSError as e:
            raise LogDirError(f"--log-dir {directory}: cannot write it ({e.strerror}); pass a writable "
                              "directory") from None

    def step(self, step: int, values: dict[str, float | None]) -> None:
        for name, v in values.items():
            if v is not None:
                self.writer.add_scalar(name, v, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
