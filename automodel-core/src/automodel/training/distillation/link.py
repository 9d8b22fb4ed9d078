"""The link between student and teacher ranks under ``separate_meshes: true``: each student rank sends its
micro-batch to its teacher rank and gets the teacher's logits back.

Every rank joins one rendezvous (torchrun's store); the link is a gloo group over all of them, made apart from
torch's default group, which the student ranks alone form (``student_store``). So the student's run is the same as
a run on its ranks only: its collectives, mesh, data shards and checkpoints never see a teacher rank. The tensors
cross through host memory (gloo), as raw bytes, so any dtype travels unchanged.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable

import torch
import torch.distributed as dist

from automodel.errors import AutomodelError
from automodel.training.distillation.ranks import RankSplit

_RUN, _STOP = 1, 0
_REQUEST, _PAYLOAD = 0, 1  # message tags: a request header (received from any student), then its tensors


class TeacherLink:
    """One rank's end of the link (``split``: which ranks are students, which teachers)."""

    def __init__(self, split: RankSplit, rank: int, timeout_minutes: float, init_method: str | None) -> None:
        timeout = datetime.timedelta(minutes=timeout_minutes)
        self.split, self.rank = split, rank
        self.store = next(dist.rendezvous(init_method or "env://", rank=rank, world_size=split.world,
                                          timeout=timeout))[0]
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("automodel_kd_link/", self.store), rank, split.world,
                                           timeout)

    def student_store(self) -> dist.Store:
        """Where the student ranks form torch's default group (a namespace of the shared rendezvous store)."""
        return dist.PrefixStore("automodel_kd_students/", self.store)

    def join_teachers(self, backend: str, timeout_minutes: float, device: torch.device) -> None:
        """(teacher rank) Form torch's default group with the other teacher ranks only (teacher rank ``i`` is
        global rank ``students + i``): the teacher's device mesh, and its tensor parallelism, live on it. ``device``
        becomes the current CUDA device first, where nccl's collectives run."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        students = self.split.students
        dist.init_process_group(backend, store=dist.PrefixStore("automodel_kd_teachers/", self.store),
                                rank=self.rank - students, world_size=self.split.world - students,
                                timeout=datetime.timedelta(minutes=timeout_minutes))

    def teacher_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(student rank) The teacher's logits of ``batch``, computed on this rank's teacher rank."""
        teacher = self.split.teacher_of(self.rank)
        tensors = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
        if len(tensors) != len(batch):
            others = sorted(set(batch) - set(tensors))
            raise AutomodelError(f"separate_meshes: true sends the micro-batch to the teacher's ranks as tensors, but "
                                 f"its keys {others} are not tensors; use separate_meshes: false with this collate_fn")
        self._send(torch.tensor([_RUN], dtype=torch.int64), teacher, _REQUEST)
        self._send_tensors(tensors, teacher)
        return self._recv_tensors(teacher)["logits"].to(next(iter(tensors.values())).device)

    def stop(self) -> None:
        """(student rank) Tell this rank's teacher rank that no more micro-batches come from it."""
        self._send(torch.tensor([_STOP], dtype=torch.int64), self.split.teacher_of(self.rank), _REQUEST)

    def serve(self, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor | None], device: torch.device,
              copy_group: dist.ProcessGroup | None = None) -> int:
        """(teacher rank) Answer each request of the students this rank's copy serves with ``forward`` of its batch
        (moved to ``device``), until every one of them has stopped; the number of batches served.

        A copy of several ranks (``copy_group``) runs each forward on all of them: the leader receives the batch,
        hands it to the others, and sends back the logits its forward returns (whole on the leader)."""
        if self.rank != self.split.leader_of(self.rank):
            return self._follow(forward, device, copy_group)
        waiting, served = len(self.split.served_by(self.rank)), 0
        while waiting:
            header = torch.zeros(1, dtype=torch.int64)
            work = self.group.recv_anysource([header], _REQUEST)
            work.wait()
            student = work._source_rank()
            if header.item() == _STOP:
                waiting -= 1
                continue
            batch = self._recv_tensors(student)
            _share(batch, copy_group, self.split.leader_index)
            self._send_tensors({"logits": forward(_to(batch, device))}, student)
            served += 1
        _share(None, copy_group, self.split.leader_index)
        return served

    def _follow(self, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor | None], device: torch.device,
                copy_group: dist.ProcessGroup | None) -> int:
        """(a teacher copy's other ranks) Run ``forward`` on each batch the leader hands over, until it says stop."""
        served = 0
        while (batch := _share(None, copy_group, self.split.leader_index)) is not None:
            forward(_to(batch, device))
            served += 1
        return served

    def close(self) -> None:
        """Drop the group and the store: gloo's threads end now, not during interpreter shutdown."""
        self.group = self.store = None

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.group.send([tensor], peer, tag).wait()

    def _recv(self, tensor: torch.Tensor, peer: int) -> None:
        self.group.recv([tensor], peer, _PAYLOAD).wait()

    def _send_tensors(self, tensors: dict[str, torch.Tensor], peer: int) -> None:
        """The keys, shapes and dtypes (JSON), then each tensor's bytes."""
        payload = [value.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for value in tensors.values()]
        spec = json.dumps([[key, list(value.shape), str(value.dtype).removeprefix("torch.")]
                           for key, value in tensors.items()]).encode()
        self._send(torch.tensor([len(spec)], dtype=torch.int64), peer, _PAYLOAD)
        self._send(torch.frombuffer(bytearray(spec), dtype=torch.uint8), peer, _PAYLOAD)
        for data in payload:
            if data.numel():
                self._send(data, peer, _PAYLOAD)

    def _recv_tensors(self, peer: int) -> dict[str, torch.Tensor]:
        length = torch.zeros(1, dtype=torch.int64)
        self._recv(length, peer)
        spec = torch.zeros(int(length.item()), dtype=torch.uint8)
        self._recv(spec, peer)
        tensors = {}
        for key, shape, dtype_name in json.loads(bytes(spec.tolist()).decode()):
            dtype = getattr(torch, dtype_name)
            value = torch.empty(shape, dtype=dtype)
            data = value.reshape(-1).view(torch.uint8)
            if data.numel():
                self._recv(data, peer)
            tensors[key] = value
        return tensors


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in batch.items()}


def _share(batch: dict[str, torch.Tensor] | None, copy_group: dist.ProcessGroup | None, leader: int
           ) -> dict[str, torch.Tensor] | None:
    """The leader's ``batch`` (None: stop) on every rank of its copy (``leader``: its rank in ``copy_group``); as
    is without a group of several ranks."""
    if copy_group is None or dist.get_world_size(copy_group) == 1:
        return batch
    message = [batch]
    dist.broadcast_object_list(message, group=copy_group, group_src=leader)
    return message[0]
