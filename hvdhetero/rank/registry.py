"""What a checkpoint or an elastic commit holds, as named parts that each save and load
themselves (torchtitan's `{name: Stateful}`), and the job's position as a small TrainState.

    parts = Registry(model=model, optimizer=PerRank(optimizer, rank), scheduler=..., loss_scale=...,
                     sync=strategy, tracked=Registry(**job.track'ed objects))
    state = {**train.state_dict(), **parts.state_dict()}     # rank/resume.py adds the rest
    parts.load_state_dict(state); train.load_state_dict(state)

A part is anything with `state_dict()` and `load_state_dict(state)` holding tensors and plain
values (so a state round-trips through torch.load(weights_only=True)). A name whose part is None
(no scheduler, no loss scaling, step sync's strategy) is saved as None and loads nothing: a
checkpoint keeps the same keys whatever the run used, and today's readers find every key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class Registry:
    """Named parts, saved and loaded in the order they were added."""

    def __init__(self, **parts: Stateful | None):
        self.parts: dict[str, Stateful | None] = dict(parts)

    def add(self, name: str, part: Stateful | None) -> None:
        self.parts[name] = part

    def state_dict(self, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
        """Every part's state (None for a part that is None); `leave_out`: names the caller fills."""
        return {name: part.state_dict() if part is not None else None
                for name, part in self.parts.items() if name not in leave_out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each part from its name's state; a name missing, None or an empty dict in `state` leaves
        its part as it is (a checkpoint of a run without a scheduler, a job.track'ed object added
        since, a GradScaler rank 0 held disabled: torch.amp.GradScaler("cuda") on a Mac saves {},
        which an enabled one refuses to load)."""
        for name, part in self.parts.items():
            value = state.get(name)
            if part is not None and value is not None and not (isinstance(value, dict) and not value):
                part.load_state_dict(value)


class PerRank:
    """The optimizer as a part: under local/diloco a checkpoint holds every rank's own inner state
    (a list), and each rank loads its own (a rank more than the run had starts from rank 0's)."""

    def __init__(self, optimizer, rank: int):
        self.optimizer, self.rank = optimizer, rank

    def state_dict(self) -> Any:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        if isinstance(state, list):
            state = state[self.rank] if self.rank < len(state) else state[0]
        self.optimizer.load_state_dict(state)


class Scheduler:
    """An LR scheduler as a part: its state_dict(), without a once-per-step `step` that job.prepare
    put on an object whose step was its own (rank/scheduling.py: no plain value). One of the
    script's own with no state_dict() (a class of a few numbers and a step()) keeps its plain
    attributes, so that --resume goes on with its schedule (it stopped the job at its first
    checkpoint)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        if self._its_own():
            return {k: v for k, v in self.scheduler.state_dict().items() if k != "step"}
        return {k: v for k, v in vars(self.scheduler).items() if _plain(v)}

    def load_state_dict(self, state: dict) -> None:
        if self._its_own():
            self.scheduler.load_state_dict(state)
            return
        for name, value in state.items():
            setattr(self.scheduler, name, value)

    def _its_own(self) -> bool:
        """It saves and loads itself (both methods: one alone would not read back what it wrote)."""
        return hasattr(self.scheduler, "state_dict") and hasattr(self.scheduler, "load_state_dict")


class Values:
    """A dict of the script's own numbers as a part (`job.track("stats", stats)`: a running reward,
    a best score, a patience counter): saved as it stands at each checkpoint, put back into the same
    dict on --resume, a tensor's values copied into the tensor it holds. NumPy numbers are saved as
    Python's (np.mean's float64 would not load back)."""

    def __init__(self, name: str, values: dict):
        self.name, self.values = name, values
        self.state_dict()  # its refusal now, at job.track, not at the first checkpoint

    def state_dict(self) -> dict:
        out = {}
        for key, value in self.values.items():
            value = _python(value)
            if type(key) not in (str, int) or not _plain(value):
                from hvdhetero.errors import ConfigError

                raise ConfigError(f"job.track({self.name!r}, a dict): its {key!r} holds a {type(value).__name__}; a "
                                  "checkpoint holds numbers, strings, None, tensors and lists and dicts of them "
                                  "(give an object of yours state_dict() and load_state_dict() instead)")
            out[key] = value
        return out

    def load_state_dict(self, state: dict) -> None:
        import torch

        for key, value in state.items():
            held = self.values.get(key)
            if isinstance(held, torch.Tensor) and isinstance(value, torch.Tensor) and held.shape == value.shape:
                with torch.no_grad():
                    held.copy_(value)  # a tensor the script holds elsewhere too stays that tensor
            else:
                self.values[key] = value


def _python(value: Any) -> Any:
    """NumPy's numbers as Python's, in lists, tuples and dicts too."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    if type(value) in (list, tuple):
        return type(value)(_python(v) for v in value)
    if type(value) is dict:
        return {k: _python(v) for k, v in value.items()}
    return value


def _plain(value: Any) -> bool:
    """What torch.load(weights_only=True) reads back: numbers, strings, None, tensors, and lists,
    tuples and dicts of them (not the optimizer a scheduler holds, nor a function). Types exactly:
    NumPy's float64 (np.cos's), an IntEnum, a namedtuple or a defaultdict would be written and
    then refused, and every checkpoint with them with it."""
    import torch

    if value is None or type(value) in (bool, int, float, str) or isinstance(value, torch.Tensor):
        return True
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) in (str, int) and _plain(v) for k, v in value.items())
    return False


@dataclass
class TrainState:
    """Where the job is: what job.epochs, the loader and the periodic checkpoints go on from."""

    step: int = 0
    """Global optimizer steps taken so far (the same on every rank; with --inner-steps by-speed
    only at round and epoch ends: a merging rank's step jumps over the steps it merged)."""
    epoch: int = 0
    start_epoch: int = 0
    """Resumed: the first epoch job.epochs yields."""
    last_checkpoint: int = 0
    """The step of the last periodic checkpoint (or the one resumed from)."""
    checkpoint_due: bool = False
    """A periodic checkpoint is taken as the next step begins."""
    last_commit: int = 0
    """--elastic: the step of this rank's last in-memory commit (rank/elastic.py)."""

    def state_dict(self, epoch_done: bool = False) -> dict[str, Any]:
        """The position a checkpoint keeps (`epoch_done`: taken at the epoch's end, so the next
        epoch follows)."""
        return {"step": self.step, "epoch": self.epoch, "epoch_done": epoch_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's or commit's position."""
        self.step = self.last_checkpoint = state["step"]
        self.epoch = self.start_epoch = state["epoch"] + (1 if state["epoch_done"] else 0)
        self.checkpoint_due = False
