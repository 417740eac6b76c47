"""A run's rows and batches: the data set of token rows, the held-out split, and `Batches`, deterministic,
resumable and sharded across ranks, read ahead by a background thread (`Prefetch`)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from dataclasses import field as dc_field

import numpy as np
import torch

from elflow.util.errors import ELFError


# ----------------------------------------------------------------------------------------------------
# Layouts
@dataclass
class TokenDataset:
    """N sequences of L token ids, with the loss mask, the real-token mask and, for conditional data, the
    source mask.

    tokens (N, L) long; mask (N, L) bool, True where the loss counts; attention_mask (N, L) bool, True at
    real tokens (False at padding); known (N, L) bool, True at the source positions of conditional data
    (None for plain text).
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    attention_mask: torch.Tensor
    known: torch.Tensor | None = None
    info: dict = dc_field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def subset(self, idx: torch.Tensor) -> "TokenDataset":
        return TokenDataset(self.tokens[idx], self.mask[idx], self.attention_mask[idx],
                            None if self.known is None else self.known[idx], dict(self.info))

    def batch(self, idx: torch.Tensor) -> dict:
        out = {"tokens": self.tokens[idx], "mask": self.mask[idx], "attention_mask": self.attention_mask[idx]}
        if self.known is not None:
            out["known"] = self.known[idx]
        return out


# ----------------------------------------------------------------------------------------------------
# The validation split
def split_rows(full, val_fraction: float, seed: int):
    """(train, validation) subsets of a row set (a TokenDataset or a store's rows): the validation rows are a
    random choice fixed by `seed`, both sets keep the rows' order."""
    if not 0.0 <= val_fraction < 1.0:
        raise ELFError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(full)
    n_val = 0 if val_fraction == 0 else max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise ELFError(f"only {n} sequences: too few for a training split and a validation split of "
                       f"{val_fraction:.0%}; use more text, a shorter --length, or --val-fraction 0")
    gen = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=gen).numpy()
    # np.sort: the sorted values without the int64 index array that torch.sort makes beside them
    val_idx, train_idx = torch.from_numpy(np.sort(perm[:n_val])), torch.from_numpy(np.sort(perm[n_val:]))
    del perm
    train, val = full.subset(train_idx), full.subset(val_idx)
    train.info["split"], val.info["split"] = "train", "val"
    return train, val


# ----------------------------------------------------------------------------------------------------
# Batches
def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"elflow-batches:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Batches:
    """Deterministic, resumable, rank-sharded batches over a TokenDataset.

    Each step draws one global batch of batch_size * world_size sequences from a permutation of the data set
    that depends only on (seed, epoch); rank r takes rows [r * batch_size, (r + 1) * batch_size) of it.
    With drop_last=False the last global batch of an epoch is filled up from the start of the permutation.
    Iterates forever (epoch after epoch) unless `epochs` is given. `state_dict()` is the data position:
    a resumed iterator yields exactly the batches the uninterrupted one would have.
    """

    def __init__(self, dataset: TokenDataset, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = True, epochs: int | None = None):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ELFError(f"bad batch layout: batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.drop_last = drop_last
        self.epochs = epochs
        self.global_batch = self.batch_size * self.world_size
        n = len(dataset)
        if n == 0:
            raise ELFError("the data set is empty: nothing to batch")
        if drop_last and n < self.global_batch:
            raise ELFError(f"the data set has {n} sequences, fewer than one global batch of {self.global_batch} "
                           f"(batch size {batch_size} x {world_size} ranks): lower the batch size, use more text "
                           "or a shorter --length")
        self.per_epoch = n // self.global_batch if drop_last else math.ceil(n / self.global_batch)
        self.epoch = 0
        self.position = 0  # global batches already taken in this epoch
        self._order_epoch, self._order = -1, None

    def __len__(self) -> int:
        return self.per_epoch

    def __iter__(self):
        return self

    @property
    def progress(self) -> float:
        """Epochs completed, fractional."""
        return self.epoch + self.position / self.per_epoch

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            order = torch.randperm(len(self.dataset), generator=gen)
            # kept as int32 where the rows fit (4 bytes a row); the values are the same
            self._order = order.to(torch.int32) if len(order) < 2**31 else order
            self._order_epoch = epoch
        return self._order

    def __next__(self) -> dict:
        if self.position >= self.per_epoch:
            if self.epochs is not None and self.epoch + 1 >= self.epochs:
                raise StopIteration
            self.epoch, self.position = self.epoch + 1, 0
        order = self._permutation(self.epoch)
        start = self.position * self.global_batch
        idx = order[start : start + self.global_batch]
        if len(idx) < self.global_batch:  # drop_last=False: fill the last batch from the epoch's start
            need = self.global_batch - len(idx)
            idx = torch.cat([idx, order.repeat(need // len(order) + 1)[:need]])
        mine = idx[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        self.position += 1
        return self.dataset.batch(mine.long())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "global_batch": self.global_batch, "num_sequences": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if int(state["num_sequences"]) != len(self.dataset):
            raise ELFError(f"cannot resume the data position: it was saved for {state['num_sequences']} sequences "
                           f"but the data set now has {len(self.dataset)}; resume with the same data, --length, "
                           "layout and validation split")
        if int(state["seed"]) != self.seed:
            raise ELFError(f"cannot resume the data position: it was saved with data seed {state['seed']}, "
                           f"now {self.seed}; resume with the same seed")
        position = int(state["position"])
        if int(state["global_batch"]) != self.global_batch:
            seen = position * int(state["global_batch"])  # the permutation depends only on (seed, epoch)
            if seen % self.global_batch:
                raise ELFError(f"cannot resume the data position: {seen} sequences of epoch {state['epoch']} were "
                               f"used, not a multiple of the new global batch {self.global_batch}; resume with "
                               f"batch size x ranks = {state['global_batch']}")
            position = seen // self.global_batch
        self.epoch, self.position = int(state["epoch"]), position


# ----------------------------------------------------------------------------------------------------------
# the loop
class Prefetch:
    """The next batches, cut into shards, read by a background thread while the current step runs: each
    item is (shards, the data position after its batch). On a GPU the shards are in pinned memory, so that
    the step's copies to the device do not wait for the host. Reads exactly `count` batches."""

    def __init__(self, batches, count: int, micro: int, accum: int, pin: bool, depth: int = 2):
        import queue
        import threading

        self.batches, self.count, self.micro, self.accum, self.pin = batches, count, micro, accum, pin
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._work, name="elflow-prefetch", daemon=True)
        self.thread.start()

    def _shards(self, batch: dict) -> list[dict]:
        m = self.micro
        shards = [{k: (v[a * m:(a + 1) * m] if torch.is_tensor(v) else v) for k, v in batch.items()}
                  for a in range(self.accum)]
        if self.pin:
            shards = [{k: v.pin_memory() if torch.is_tensor(v) else v for k, v in sh.items()} for sh in shards]
        return shards

    def _work(self) -> None:
        import queue

        for _ in range(self.count):
            try:
                item = (self._shards(next(self.batches)), self.batches.state_dict())
            except BaseException as e:  # noqa: BLE001  (raised in the loop's thread by __next__)
                item = e
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self.stop.is_set() or isinstance(item, BaseException):
                return

    def __next__(self):
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
