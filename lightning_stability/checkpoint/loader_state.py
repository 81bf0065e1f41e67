"""Exact mid-epoch resume for plain ``DataLoader``\\s: the data position and every rank's RNG states in each
checkpoint, and a fast-forward of the sampler at resume.

Lightning resumes mid-epoch only for a loader with ``state_dict``/``load_state_dict`` (torchdata's
``StatefulDataLoader``); a plain ``DataLoader`` restarts the epoch at its first batch. :class:`LoaderResume` makes a
plain one resume where it stopped, the way the HF Trainer does (``accelerate.skip_first_batches`` and the per-process
``rng_state_<rank>.pth``):

* **The batches.** Each training loader's index sampler (``loader.batch_sampler``, else ``loader.sampler``) is
  wrapped in a :class:`ReplayableSampler`. At the start of each of its iterations (each epoch) it records the RNG
  states its order is drawn from: torch's, NumPy's and Python's global generators and the ``generator`` of the
  sampler and of the sampler under a batch sampler. A ``RandomSampler`` (``shuffle=True``) draws its permutation
  from them right then. A checkpoint holds that record, the epoch and the number of batches of the epoch consumed;
  at resume the sampler replays the record and skips those batches' indices (no sample is loaded), and the epoch
  goes on with the next batch. A ``DistributedSampler`` (Lightning's, under DDP and FSDP) and a
  ``SequentialSampler`` are a function of their epoch, which Lightning sets.
* **The RNG states** of every rank (:mod:`~lightning_stability.checkpoint.rng`) and each loader's ``generator``,
  put back when training starts again: dropout and random augmentation draw what they drew.
* **Another number of processes.** The checkpoint also holds the recipe of the epoch's global order and the global
  batch (:mod:`~lightning_stability.checkpoint.epoch_order`). A resume on ``W'`` processes with the same global
  batch deals the rest of that order over them (:meth:`ReplayableSampler.deal`): every sample of the epoch once,
  in the same global batches. A rank keeps its saved RNG states; a rank the checkpoint has none of gets rank 0's
  re-seeded for it (:func:`~lightning_stability.checkpoint.rng.derive`). Another global batch, or an order with no
  recipe (a custom sampler), is said once and the epoch restarts.

Left alone: a loader that has ``state_dict`` and ``load_state_dict`` (Lightning restores it). Not exact, said once at
fit start with the fix: an ``IterableDataset`` or an iterable that is not a ``DataLoader`` (no index sampler to
fast-forward), several training loaders, and the draws made inside a loader's worker processes
(``num_workers > 0``: the batches are exact, a random augmentation in ``Dataset.__getitem__`` is not).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_stability import _compat, ranks
from lightning_stability.checkpoint import epoch_order, rng

#: the checkpoint's key for what :meth:`LoaderResume.capture` returns
KEY = "lightning_stability_resume"
#: how many of the newest yielded items a sampler remembers (the loader prefetches a few batches ahead)
_KEEP_POSITIONS = 64
_END = object()  # the end of an iteration
_TORCH_SAMPLERS = (
    SequentialSampler,
    RandomSampler,
    DistributedSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    BatchSampler,
)
_STATEFUL_FIX = (
    "torchdata's StatefulDataLoader (`from torchdata.stateful_dataloader import StatefulDataLoader`, a drop-in "
    "DataLoader), or a loader with state_dict()/load_state_dict(): Lightning saves and restores those itself"
)
_WORLD_FIX = (
    "To resume exactly on another number of processes, keep the global batch (batch size per process x "
    "processes) and use torch's samplers (shuffle=True or False, or Lightning's DistributedSampler); or resume "
    "on the checkpoint's number of processes."
)


def is_stateful(loader: Any) -> bool:
    """Whether Lightning saves and restores ``loader`` itself (it has ``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


# ---------------------------------------------------------------------------------------------- the sampler
def _generators(sampler: Any) -> list[torch.Generator]:
    """The torch generators a sampler draws its order from besides the global one: its ``generator`` and that of
    the sampler it batches."""
    found: list[torch.Generator] = []
    for obj in (sampler, getattr(sampler, "sampler", None)):
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def _global_states() -> dict[str, Any]:
    states = rng.capture()
    states.pop("cuda", None)  # samplers run on the host
    return states


class ReplayableSampler:
    """An index sampler that records the RNG states at the start of each iteration and can replay one iteration
    from a record, skipping its first items.

    Attributes other than its own are the wrapped sampler's (``set_epoch``, ``sampler``, ``batch_size``...).

    Args:
        inner: the loader's ``batch_sampler`` (or ``sampler`` when it has none).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.start: dict[str, Any] | None = None  # the record of the current (or last) iteration
        self._replay: tuple[dict[str, Any], int] | None = None
        #: sample indices never to yield again (``StepReplay``'s quarantine). A batch left with no sample keeps its
        #: position, so that every rank yields as many batches and a resume counts them alike: a stand-in is
        #: yielded there (:meth:`stand_in_at`), the step that trains on it to be skipped
        self.exclude: set[int] = set()
        self._yielded: deque[tuple[int, Any]] = deque(maxlen=_KEEP_POSITIONS)  # (position in the epoch, item)
        self._stand_ins: set[int] = set()  # the positions of this iteration that yielded a stand-in
        #: the recipe of the saved epoch's order (:mod:`.epoch_order`) while this iteration deals the rest of it on
        #: another world size; ``None`` while it runs its own order
        self.dealt: dict[str, Any] | None = None
        self._deal: tuple[list[list[int]], dict[str, Any], int] | None = None

    def item_at(self, position: int) -> Any | None:
        """What the current iteration yielded at ``position`` (a batch's index list, or one index): the samples of
        the batch with that ``batch_idx``; ``None`` when it is not among the newest yielded."""
        for where, item in reversed(self._yielded):
            if where == position:
                return item
        return None

    def stand_in_at(self, position: int) -> bool:
        """Whether the current iteration yielded a stand-in at ``position``: every sample of its batch is
        excluded, and another batch's samples were yielded in its place (to be loaded, never trained on)."""
        return position in self._stand_ins

    def __getattr__(self, name: str) -> Any:
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def replay(self, start: dict[str, Any], skip: int) -> None:
        """Make the next iteration draw its order from ``start`` (a record) and skip its first ``skip`` items."""
        self._replay = (start, skip)

    def deal(self, batches: list[list[int]], recipe: dict[str, Any], position: int) -> None:
        """Make the next iteration yield ``batches`` (this rank's share of the rest of the epoch ``recipe``
        describes), numbered from ``position``, in place of its own order; the iteration after is its own again."""
        self._deal = (batches, recipe, position)

    def __iter__(self) -> Iterator[Any]:
        replay, self._replay = self._replay, None
        dealt, self._deal = self._deal, None
        self._yielded.clear()
        self._stand_ins = set()
        self.dealt = None
        if dealt is not None:
            batches, self.dealt, position = dealt
            self.start = None
            yield from self._kept(iter(batches), position)
            return
        if replay is None:
            self.start = {"global": _global_states(), "generators": [g.get_state() for g in _generators(self.inner)]}
            yield from self._kept(iter(self.inner), 0)
            return
        start, skip = replay
        self.start = start
        outside = _global_states()  # the resumed run's own states: back once the order is drawn
        try:
            rng.restore(start["global"])
            for gen, state in zip(_generators(self.inner), start["generators"], strict=False):
                gen.set_state(state)
            items = iter(self.inner)
            last = None
            for _ in range(skip):
                left = self._left(next(items))  # the index lists of the consumed batches only: no sample is loaded
                last = last if left is None else left
        finally:
            rng.restore(outside)
        yield from self._kept(items, skip, last)

    def _left(self, item: Any) -> Any | None:
        """``item`` (a batch's index list, or one index) without the excluded indices; ``None`` when none is left."""
        if not self.exclude:
            return item
        if isinstance(item, int):
            return None if item in self.exclude else item
        kept = [i for i in item if i not in self.exclude]
        return kept or None

    def _kept(self, items: Iterator[Any], position: int, last: Any | None = None) -> Iterator[Any]:
        """``items`` without the excluded indices, each recorded with its position in the epoch. An item with no
        index left keeps its position: a stand-in takes it (:meth:`stand_in_at`), the last item with indices left
        (``last``: also one of those skipped at a resume, so that a resumed run yields what the run did), else the
        next one, else, when no sample of the epoch is left, the item itself."""
        ahead: deque[Any] = deque()  # items read past, to find a stand-in at the iteration's start
        while True:
            item = ahead.popleft() if ahead else next(items, _END)
            if item is _END:
                return
            left = self._left(item)
            if left is None:
                stand_in = last if last is not None else self._next_left(items, ahead)
                self._stand_ins.add(position)
                item = item if stand_in is None else stand_in
            else:
                item = last = left
            self._yielded.append((position, item))
            position += 1
            yield item

    def _next_left(self, items: Iterator[Any], ahead: deque[Any]) -> Any | None:
        """The next item with indices left, read past into ``ahead`` (they are yielded in turn later)."""
        for item in ahead:
            left = self._left(item)
            if left is not None:
                return left
        for item in items:
            ahead.append(item)
            left = self._left(item)
            if left is not None:
                return left
        return None


def _index_sampler_name(loader: DataLoader) -> str:
    return "batch_sampler" if loader.batch_sampler is not None else "sampler"


def install(loader: DataLoader) -> ReplayableSampler:
    """Wrap ``loader``'s index sampler in a :class:`ReplayableSampler` (once; returns it).

    ``DataLoader`` refuses ``loader.batch_sampler = ...`` after construction (its ``__setattr__``), for loaders being
    iterated; the loader is between iterations here, and the iterator built next reads the wrapper.
    """
    name = _index_sampler_name(loader)
    current = getattr(loader, name)
    if isinstance(current, ReplayableSampler):
        return current
    wrapper = ReplayableSampler(current)
    object.__setattr__(loader, name, wrapper)
    return wrapper


def training_sampler(
    trainer: pl.Trainer, fresh_epoch: bool = False, owner: str = "lightning_stability"
) -> ReplayableSampler | None:
    """The training loader's :class:`ReplayableSampler`, installed now if it is not yet; ``None`` where there is no
    index sampler to wrap (several loaders, an iterable stream, a loader Lightning restores itself).

    Installed during ``on_train_start``, the fit loop's iterator is rebuilt through it and every RNG state it drew
    from is put back, so the run draws what it would have drawn; with ``fresh_epoch`` (at
    ``on_train_epoch_start``, before the epoch's iterator is built) it is only installed. ``owner``: the callback
    a warning names.
    """
    loaders = _compat.train_loaders(trainer)
    if len(loaders) != 1 or not _replayable(loaders[0]):
        return None
    loader = loaders[0]
    current = getattr(loader, _index_sampler_name(loader))
    if isinstance(current, ReplayableSampler):
        return current
    here = _local_states(loaders)
    wrapper = install(loader)
    if not fresh_epoch and _compat.restart_train_iterator(trainer):
        _put_back(loaders, here, owner)
    return wrapper


def _custom_sampler(loader: DataLoader) -> Any | None:
    """The loader's sampler or batch sampler when it is not one of torch's (whose orders are known to replay)."""
    for obj in (loader.batch_sampler, loader.sampler):
        inner = obj.inner if isinstance(obj, ReplayableSampler) else obj
        if inner is not None and type(inner) not in _TORCH_SAMPLERS:
            return inner
    return None


# ---------------------------------------------------------------------------------------------- the callback's part
class LoaderResume:
    """The data position and RNG states in each checkpoint, and their restore when a fit resumes (see module doc).

    :class:`~lightning_stability.checkpoint.exact_resume.ExactResume` drives it (alone, or inside
    ``StableCheckpoint``): :meth:`capture` in ``on_save_checkpoint`` (every rank: a collective), :meth:`load` in
    ``on_load_checkpoint``, :meth:`start` in ``on_train_start``, :meth:`epoch_start` in ``on_train_epoch_start``.

    Args:
        owner: the callback its messages name (the one the user attached).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.pending: dict[str, Any] | None = None  # what the resumed checkpoint holds, until training starts

    def capture(self, trainer: pl.Trainer) -> dict[str, Any]:
        """What a checkpoint needs to resume the data and the RNG exactly (every rank must call it together)."""
        loaders = _compat.train_loaders(trainer)
        local = {
            "rng": rng.capture(),
            "samplers": [
                loader.batch_sampler.start
                if isinstance(loader, DataLoader) and isinstance(loader.batch_sampler, ReplayableSampler)
                else loader.sampler.start
                if isinstance(loader, DataLoader) and isinstance(loader.sampler, ReplayableSampler)
                else None
                for loader in loaders
            ],
            "generators": [
                loader.generator.get_state() if isinstance(loader, DataLoader) and loader.generator else None
                for loader in loaders
            ],
        }
        world = ranks.world_size()
        return {
            "version": 1,
            "epoch": trainer.current_epoch,
            "batches": int(trainer.fit_loop.epoch_loop.batch_progress.current.ready),
            "lengths": [_length(loader) for loader in loaders],
            "ranks": ranks.gather_objects(local),
            # to resume on another world size (the same on every rank): each loader's epoch order and global batch
            "orders": [_recipe(loader) for loader in loaders],
            "global_batches": [(_batch_size(loader) or 0) * world or None for loader in loaders],
        }

    def load(self, checkpoint: dict[str, Any]) -> None:
        self.pending = checkpoint.get(KEY)

    def start(self, trainer: pl.Trainer) -> None:
        """At ``on_train_start`` (the fit loop built its iterator, no batch was fetched): wrap the samplers, say
        what cannot resume exactly, and on a resume fast-forward the epoch and put back every RNG state."""
        saved, self.pending = self.pending, None
        # resumed at an epoch's last batch: the next epoch starts as in the uninterrupted run (its sampler epoch, its
        # on_train_epoch_start, and the epoch progress that the checkpoints saved in it hold)
        _compat.start_next_epoch_as_new(trainer)
        loaders = _compat.train_loaders(trainer)
        if not loaders:
            return
        managed = self._check(loaders)
        wrappers = [install(loader) for loader in managed]
        here = _local_states(loaders)
        rank, world = trainer.global_rank, ranks.world_size()
        if saved is None:
            # a fresh fit: rebuild the iterator through the wrappers, drawing nothing from the run's generators
            if wrappers and _compat.restart_train_iterator(trainer):
                _put_back(loaders, here, self.owner)
            return
        orders = saved.get("orders") or [None] * len(loaders)
        if len(saved["ranks"]) != world or any(order is not None and order.get("dealt") for order in orders):
            self._deal_rest(trainer, saved, loaders, wrappers)
            return
        mine = saved["ranks"][rank]
        batches, epoch = int(saved["batches"]), int(saved["epoch"])
        lengths = [_length(loader) for loader in loaders]
        total = trainer.num_training_batches
        mid_epoch = 0 < batches < total and epoch == trainer.current_epoch
        if mid_epoch and wrappers and len(wrappers) == len(loaders):
            starts = mine["samplers"]
            if lengths != saved["lengths"] or any(start is None for start in starts):
                why = (
                    f"the training loader has {lengths} batches per epoch, the checkpoint's had {saved['lengths']}"
                    if lengths != saved["lengths"]
                    else "the checkpoint holds no record of the sampler's order (saved while it was not replayable)"
                )
                rank_zero_warn(
                    f"{self.owner}: {why}; the epoch restarts at its first batch. Resume with the same data, "
                    "batch size and number of processes to continue exactly."
                )
            else:
                for wrapper, start in zip(wrappers, starts, strict=True):
                    wrapper.replay(start, batches)
            _compat.restart_train_iterator(trainer)  # through the wrapper, which records this epoch's order
            _put_back(loaders, mine, self.owner)
            return
        if not mid_epoch and wrappers:
            # the epoch had ended: the next one's iterator draws its order from the restored states
            _put_back(loaders, mine, self.owner)
            _compat.restart_train_iterator(trainer)
            return
        _put_back(loaders, mine, self.owner)

    def _deal_rest(
        self, trainer: pl.Trainer, saved: dict[str, Any], loaders: list[Any], wrappers: list[ReplayableSampler]
    ) -> None:
        """A resume on another world size (or of an epoch that one dealt): this rank's RNG states (:func:`_states_of`)
        and, mid-epoch, its share of the rest of the saved epoch's order (:mod:`.epoch_order`), when the global
        batch is the same; otherwise said once, and the epoch restarts at its first batch."""
        rank, world, saved_world = trainer.global_rank, ranks.world_size(), len(saved["ranks"])
        mine = _states_of(saved["ranks"], rank, len(loaders))
        batches, epoch = int(saved["batches"]), int(saved["epoch"])
        total = trainer.num_training_batches
        if not (0 < batches < total and epoch == trainer.current_epoch) or not wrappers:
            # at an epoch's end (or nothing to fast-forward): the next epoch is this world's own order
            _put_back(loaders, mine, self.owner)
            if wrappers:
                _compat.restart_train_iterator(trainer)
            return
        wrapper, loader = wrappers[0], loaders[0]
        recipe = (saved.get("orders") or [None])[0]
        global_batch = (saved.get("global_batches") or [None])[0]
        size, drop_last = _batch_size(loader), bool(getattr(wrapper.inner, "drop_last", False))
        why = _not_dealt(recipe, global_batch, saved_world, size, world)
        shares: list[list[list[int]]] = []
        if why is None:
            assert recipe is not None and global_batch is not None and size is not None
            order = epoch_order.rebuild(recipe)
            shares = [epoch_order.deal(order, batches * global_batch, r, world, size, drop_last) for r in range(world)]
            if any(len(share) != total - batches for share in shares):
                why = (
                    f"the rest of the saved epoch ({len(order) - batches * global_batch} samples) does not deal "
                    f"into {total - batches} batches of {size} on each of the {world} processes"
                )
        if why is not None:
            rank_zero_warn(
                f"{self.owner}: the checkpoint was saved mid-epoch by {saved_world} processes and this run has "
                f"{world}: {why}. The epoch restarts at its first batch (its samples before the checkpoint are "
                "trained on again); the RNG states continue (rank 0's re-seeded for a rank the checkpoint has none "
                f"of). {_WORLD_FIX}"
            )
        else:
            wrapper.deal(shares[rank], {**recipe, "dealt": True}, batches)
        _compat.restart_train_iterator(trainer)
        _put_back(loaders, mine, self.owner)

    def epoch_start(self, trainer: pl.Trainer) -> None:
        """At ``on_train_epoch_start``: wrap the samplers of loaders Lightning built anew for this epoch
        (``reload_dataloaders_every_n_epochs``); the epoch's iterator is built after this hook."""
        training_sampler(trainer, fresh_epoch=True, owner=self.owner)

    # ------------------------------------------------------------------ fit-start checks
    def _check(self, loaders: list[Any]) -> list[DataLoader]:
        """The loaders to fast-forward (empty where none can be); says once what cannot resume exactly."""
        if all(is_stateful(loader) for loader in loaders):
            return []  # Lightning resumes them
        plain = [loader for loader in loaders if not is_stateful(loader)]
        if len(loaders) > 1:
            rank_zero_warn(
                f"{self.owner}: {len(loaders)} training loaders: a resume from a mid-epoch checkpoint restarts "
                f"the epoch of those without state_dict. Fix: combine them into one loader, or use {_STATEFUL_FIX}."
            )
            return []
        loader = plain[0]
        if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
            what = type(loader.dataset).__name__ if isinstance(loader, DataLoader) else type(loader).__name__
            rank_zero_warn(
                f"{self.owner}: the training data ({what}) is an iterable stream without state_dict, which "
                "cannot be fast-forwarded: a resume from a mid-epoch checkpoint restarts the epoch at its first "
                f"batch (the RNG states are restored). Fix: {_STATEFUL_FIX}."
            )
            return []
        if loader.num_workers > 0:
            rank_zero_warn(
                f"{self.owner}: the training loader has num_workers={loader.num_workers}; a resume from a "
                "mid-epoch checkpoint trains on the same batches, but random draws made inside its worker "
                "processes (augmentation in Dataset.__getitem__ or collate_fn) are not replayed: each worker's "
                "generators live in its process. Fix: draw them from a torch.Generator seeded with the sample's "
                "index and the epoch, or apply the augmentation in the training step (whose RNG is restored)."
            )
        custom = _custom_sampler(loader)
        if custom is not None:
            rank_zero_info(
                f"{self.owner}: the training loader's {type(custom).__name__} resumes mid-epoch by replaying its "
                "order and skipping the consumed batches: exact when it draws its order when its iteration starts "
                "(from torch's, NumPy's or Python's global RNG, or its `generator`) or from its epoch (set_epoch); "
                "not when it draws from a global RNG while the epoch runs. If it cannot, give it or the loader "
                "state_dict()/load_state_dict()."
            )
        return [loader]


def _not_dealt(
    recipe: dict[str, Any] | None, global_batch: int | None, saved_world: int, size: int | None, world: int
) -> str | None:
    """Why the rest of a saved epoch cannot be dealt over ``world`` processes of ``size`` samples per batch
    (``None``: it can, exactly)."""
    if recipe is None or global_batch is None:
        return (
            "the checkpoint holds no order of its epoch that another number of processes can deal (a sampler other "
            "than torch's DistributedSampler, RandomSampler or SequentialSampler, or a checkpoint of an older version)"
        )
    if size is None or size * world != global_batch:
        per = global_batch // world
        return (
            f"its global batch was {global_batch} samples ({saved_world} x {global_batch // saved_world}) and this "
            f"run's is {size * world if size else 'unknown'} ({world} x {size}); "
            + (
                f"a batch size of {per} per process keeps it"
                if per * world == global_batch
                else f"no batch size per process keeps it on {world} processes: resume on a number that divides it"
            )
        )
    return None


def _states_of(ranks: list[dict[str, Any]], rank: int, count: int) -> dict[str, Any]:
    """``rank``'s RNG states and loader generators in a checkpoint saved by ``len(ranks)`` processes: its own, or
    for a rank the checkpoint has none of, rank 0's re-seeded for it (:func:`rng.derive`; generators left as
    they are)."""
    if rank < len(ranks):
        return {"rng": ranks[rank]["rng"], "generators": ranks[rank]["generators"]}
    return {"rng": rng.derive(ranks[0]["rng"], rank), "generators": [None] * count}


def _recipe(loader: Any) -> dict[str, Any] | None:
    """The recipe of ``loader``'s current epoch order (:func:`.epoch_order.describe`), marked ``dealt`` when this
    epoch deals a saved one."""
    wrapper = getattr(loader, "batch_sampler", None) if isinstance(loader, DataLoader) else None
    if not isinstance(wrapper, ReplayableSampler):
        return None
    return wrapper.dealt if wrapper.dealt is not None else epoch_order.describe(wrapper.inner, wrapper.start)


def _batch_size(loader: Any) -> int | None:
    """Samples per batch of this process (its batch sampler's ``batch_size``)."""
    index = getattr(loader, "batch_sampler", None) if isinstance(loader, DataLoader) else None
    index = index.inner if isinstance(index, ReplayableSampler) else index
    size = getattr(index, "batch_size", None)
    return size if isinstance(size, int) else None


def _replayable(loader: Any) -> bool:
    """A map-style ``DataLoader`` that Lightning does not restore itself: its sampler can be replayed."""
    return (
        isinstance(loader, DataLoader) and not is_stateful(loader) and not isinstance(loader.dataset, IterableDataset)
    )


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _local_states(loaders: list[Any]) -> dict[str, Any]:
    return {
        "rng": rng.capture(),
        "generators": [
            loader.generator.get_state() if isinstance(loader, DataLoader) and loader.generator else None
            for loader in loaders
        ],
    }


def _put_back(loaders: list[Any], states: dict[str, Any], owner: str) -> None:
    """Restore this rank's RNG states and each loader's ``generator`` (warned once when one cannot be)."""
    problems = rng.restore(states["rng"])
    for loader, state in zip(loaders, states["generators"], strict=False):
        if state is not None and isinstance(loader, DataLoader) and loader.generator is not None:
            loader.generator.set_state(state)
    if problems:
        rank_zero_warn(f"{owner}: could not restore the RNG state of {', '.join(problems)}.")
