"""Starting tensor-parallel ranks and keeping watch over them.

One process per rank. On one host, the process that runs the engine (rank 0) starts the other
ranks itself (`python -m kvship.runner.tp.worker`). Across hosts, every host runs the same
`kvship serve ...` command and the environment says where it belongs (what the operator sets
for a multi-pod group):

    MASTER_ADDR, MASTER_PORT          where rank 0 listens (the rendezvous store)
    KVSHIP_NNODES (or NNODES)         how many hosts share the model
    KVSHIP_NODE_RANK (or NODE_RANK, LWS_WORKER_INDEX; else the ordinal N of a hostname `name-N`)

Each host runs tensor_parallel_size / nnodes ranks; host 0's first rank is the engine (the only
one with an HTTP server), every other rank only runs the worker loop. One process per rank with
RANK / WORLD_SIZE set (torchrun style) is accepted as well.

Failures are never silent: rank 0 polls the ranks it started and reads every rank's heartbeat
counter in the rendezvous store; workers watch rank 0 the same way. A rank that dies or stops
beating is logged by number; rank 0 kills the ranks it started (so that a collective stuck on
them fails), and if the failure does not reach the engine's caller within a grace period (the
engine thread is stuck in a collective), the process exits with status 1.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvship import envs
from kvship.layers.attention import AttentionMetadata
from kvship.parallel import TPContext
from kvship.ports import free_port
from kvship.runner.tp.one_shot import try_fused_norm, try_one_shot

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
FAILURE_GRACE_S = 10.0  # a failure not reported to the engine's caller by then ends the process
STEP, STOP = 1, 0
# cmd, tokens, seqs, block-table width, sampled rows, max_seqlen_q, leading decodes, state tensors sent
# (0; 1: the slots; 2: the slots and a verify's state rows),
# a hybrid model's state copies before and after the forward (Batch.state_restores, state_checkpoints),
# and LoRA: per-token adapter slots sent (0 or tokens) and the bytes of the slot loads (JSON)
_HEADER = 12


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung, or a collective failed."""


# -- where this process belongs ---------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    world_size: int
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int | None  # None: one host, rank 0 picks a free port
    rank: int  # global rank of this process
    local_rank: int

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def _hostname_ordinal(hostname: str) -> int | None:
    m = re.search(r"-(\d+)$", hostname.split(".")[0])
    return int(m.group(1)) if m else None


def resolve_placement(tp_size: int, env: dict | None = None, hostname: str | None = None) -> Placement:
    """This process's place in a group of tp_size ranks, from the environment (see module doc)."""
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None
    started = envs.started_rank(env)
    if started is not None:  # a rank started by a node leader (python -m kvship.runner.tp.worker)
        rank, local, nproc = started
        nproc = nproc or tp_size
        return Placement(tp_size, tp_size // nproc, rank // nproc, nproc, addr, port, rank, local)
    nnodes_s = envs.nnodes(env) or env.get("NNODES")
    node_s = envs.node_rank(env) or env.get("NODE_RANK") or env.get("LWS_WORKER_INDEX")
    if nnodes_s is None and env.get("WORLD_SIZE") and env.get("RANK"):  # one process per rank
        nnodes_s, node_s = env["WORLD_SIZE"], env["RANK"]
    nnodes = int(nnodes_s or 1)
    if nnodes < 1 or tp_size % nnodes:
        raise ValueError(f"tensor_parallel_size={tp_size} must be a multiple of the number of hosts ({nnodes})")
    if nnodes == 1:
        return Placement(tp_size, 1, 0, tp_size, addr, port, 0, 0)
    if node_s is None:
        host = hostname if hostname is not None else socket.gethostname()
        ordinal = _hostname_ordinal(host)
        if ordinal is None:
            raise ValueError(f"{nnodes} hosts but no host rank: set {envs.NODE_RANK} (or use hostnames ending in -N; "
                             f"this one is {host!r})")
        node_s = str(ordinal)
    node_rank = int(node_s)
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"host rank {node_rank} is outside 0..{nnodes - 1}")
    if "MASTER_ADDR" not in env:
        raise ValueError(f"{nnodes} hosts: set MASTER_ADDR (and MASTER_PORT) to host 0's address")
    nproc = tp_size // nnodes
    return Placement(tp_size, nnodes, node_rank, nproc, addr, port or 29500, node_rank * nproc, 0)


def uses_cuda(config) -> bool:
    return config.device != "cpu" and (config.device.startswith("cuda") or torch.cuda.is_available())


# -- one rank's runtime -----------------------------------------------------------------------
class TPRuntime:
    """The process group, the ranks this process started, and the watch over all of them."""

    def __init__(self, config, placement: Placement):
        self.config = config
        self.placement = placement
        self.rank = placement.rank
        self.size = placement.world_size
        self.cuda = uses_cuda(config)
        self.children: dict[int, subprocess.Popen] = {}
        self.failure: str | None = None
        self.failed_rank: int | None = None
        self._failed = threading.Event()
        self._surfaced = False
        self._stopping = threading.Event()
        self._closed = False
        self.ready = False  # set once this rank's model runner exists (it then takes step messages)
        self._threads_before: int | None = None
        self.ctx: TPContext | None = None
        self._parent_pid = envs.parent_pid()

    # -- start ---------------------------------------------------------------------------------
    @classmethod
    def start(cls, config, placement: Placement | None = None) -> "TPRuntime":
        placement = placement or resolve_placement(config.tensor_parallel_size)
        if placement.master_port is None:
            placement = dataclasses.replace(placement, master_port=free_port())
        rt = cls(config, placement)
        try:
            rt._start()
        except BaseException:
            rt.shutdown()
            raise
        return rt

    def _start(self) -> None:
        p = self.placement
        if self.cuda:
            n = torch.cuda.device_count()
            if p.nproc_per_node > n:
                raise ValueError(f"{p.nproc_per_node} tensor-parallel ranks on this host but only {n} GPUs")
            torch.cuda.set_device(p.local_rank)
        else:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // p.nproc_per_node))
        if p.nnodes == 1 and os.path.exists("/sys/class/net/lo"):  # gloo needs no resolvable hostname then
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if p.local_rank == 0:
            self._spawn_local_ranks()
        self._watch_thread = threading.Thread(target=self._watch, name=f"kvship-tp-watch-{self.rank}", daemon=True)
        log.info("tensor-parallel rank %d/%d: joining %s:%d (%s)", self.rank, self.size, p.master_addr,
                 p.master_port, "nccl" if self.cuda else "gloo")
        timeout = timedelta(seconds=envs.tp_timeout_s())
        self._watch_children_only = True
        self._watch_thread.start()  # children that die during start-up are reported too
        dist.init_process_group("nccl" if self.cuda else "gloo", init_method=f"tcp://{p.master_addr}:{p.master_port}",
                                rank=self.rank, world_size=self.size, timeout=timeout)
        group = dist.group.WORLD
        # Workers wait on this group between steps for as long as the server is idle.
        cpu_group = dist.new_group(list(range(self.size)), backend="gloo", timeout=timedelta(days=30))
        one_shot = fused_norm = None
        if self.cuda:
            device = torch.device("cuda", torch.cuda.current_device())
            one_shot = try_one_shot(group, device, self.config.tp_all_reduce)
            fused_norm = try_fused_norm(group, device, self.config.tp_all_reduce)
        self.ctx = TPContext(self.rank, self.size, group, cpu_group, self, one_shot, fused_norm)
        self._store = dist.TCPStore(p.master_addr, p.master_port, is_master=False,
                                    timeout=timedelta(seconds=30), wait_for_workers=False)
        self._watch_children_only = False
        atexit.register(self.shutdown)

    def _spawn_local_ranks(self) -> None:
        p = self.placement
        env = dict(os.environ, MASTER_ADDR=p.master_addr, MASTER_PORT=str(p.master_port))
        for local in range(1, p.nproc_per_node):
            rank = p.rank + local
            env.update(envs.started_rank_env(dataclasses.asdict(self.config), p.nproc_per_node, os.getpid(),
                                             rank, local))
            self.children[rank] = subprocess.Popen([sys.executable, "-m", "kvship.runner.tp.worker"], env=env)
            log.info("started tensor-parallel rank %d (pid %d)", rank, self.children[rank].pid)

    # -- watch ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        timeout = envs.tp_heartbeat_timeout_s()
        watched = range(1, self.size) if self.rank == 0 else [0]
        last: dict[int, tuple[int, float]] = {}
        while not self._stopping.wait(0.25 if self._watch_children_only else HEARTBEAT_INTERVAL_S / 2):
            for rank, proc in self.children.items():
                code = proc.poll()
                if code is not None and not self._stopping.is_set():
                    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                    self._fail(rank, f"(pid {proc.pid}) {how}")
            if self._parent_pid and os.getppid() != self._parent_pid and not self._stopping.is_set():
                self._fail(self.placement.rank - self.placement.local_rank,
                           f"(pid {self._parent_pid}, which started this rank) is gone")
            if self._watch_children_only or self._failed.is_set():
                continue
            now = time.monotonic()
            try:
                self._store.add(f"kvship/tp/hb/{self.rank}", 1)
                for r in watched:
                    v = self._store.add(f"kvship/tp/hb/{r}", 0)
                    if r not in last or last[r][0] != v:
                        last[r] = (v, now)
                    elif now - last[r][1] > timeout and not self._stopping.is_set():
                        self._fail(r, f"stopped responding (no heartbeat for {now - last[r][1]:.0f}s)")
            except Exception as e:  # noqa: BLE001 - the store lives in rank 0's process
                if not self._stopping.is_set():
                    self._fail(0, f"is unreachable (rendezvous store: {e})")

    def _fail(self, rank: int, why: str) -> None:
        if self._failed.is_set():
            return
        self.failed_rank, self.failure = rank, f"tensor-parallel rank {rank} {why}"
        self._failed.set()
        log.error("%s (seen by rank %d)", self.failure, self.rank)
        for proc in self.children.values():  # a collective waiting on them fails instead of hanging
            if proc.poll() is None:
                proc.kill()
        if self.rank != 0:
            log.error("rank %d exits", self.rank)
            os._exit(1)

        def unreported() -> None:
            if not self._surfaced and not self._closed:
                log.error("%s; the engine is stuck in a collective: exiting", self.failure)
                logging.shutdown()
                os._exit(1)

        t = threading.Timer(FAILURE_GRACE_S, unreported)
        t.daemon = True
        t.start()

    def error(self, cause: BaseException | None = None, wait_s: float = 3.0) -> TensorParallelError:
        """The error to raise for a failed step, naming the rank when the watch can tell."""
        self._failed.wait(wait_s if cause is not None else 0)
        self._surfaced = True
        msg = self.failure or f"a tensor-parallel collective failed on rank {self.rank}: {cause}"
        return TensorParallelError(msg)

    @contextmanager
    def guard(self):
        """Around one step: a failed rank becomes a TensorParallelError naming it."""
        if self._failed.is_set() or self._closed:
            raise self.error() if self._failed.is_set() else TensorParallelError("tensor parallelism was shut down")
        try:
            yield
        except TensorParallelError:
            self._surfaced = True
            raise
        except Exception as e:
            raise self.error(e) from e

    # -- per step --------------------------------------------------------------------------------
    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                  copies: tuple[list, list] = ([], []), lora: tuple[list, list] = ([], [])) -> None:
        """Rank 0: the flat step tensors to every other rank (a small header, then one tensor).
        ``copies``: a hybrid model's state copies, (from, to) pairs before and after the forward.
        ``lora``: per-token adapter slots ([] when none has one) and the adapters loaded into
        slots since the last step, (slot, id, name, path) (runner/lora_manager.py)."""
        bt = meta.block_tables
        n_seq, width = bt.shape
        state = [t.long() for t in (meta.state_slots, meta.spec_state_rows) if t is not None]  # a hybrid model's
        loads = list(json.dumps(lora[1]).encode()) if lora[1] else []
        header = torch.tensor([STEP, input_ids.shape[0], n_seq, width, meta.logits_indices.shape[0],
                               meta.max_seqlen_q, meta.num_decodes, len(state), *map(len, copies), len(lora[0]),
                               len(loads)], dtype=torch.int64)
        dist.broadcast(header, 0, group=self.ctx.cpu_group)
        pairs = torch.tensor([x for part in copies for pair in part for x in pair], dtype=torch.int64)
        extra = torch.tensor([*lora[0], *loads], dtype=torch.int64)
        payload = torch.cat([input_ids, positions, meta.slot_mapping, bt.reshape(-1).long(), meta.seq_lens.long(),
                             meta.cu_seqlens_q.long(), meta.logits_indices, *state, pairs.to(input_ids.device),
                             extra.to(input_ids.device)])
        dist.broadcast(payload, 0, group=self.ctx.group)

    def recv_step(self, device: torch.device):
        """Other ranks: (input_ids, positions, AttentionMetadata, state copies before and after
        the forward as [n, 2] tensors, LoRA's (per-token slots or None, slot loads)), or None
        when rank 0 stops."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.ctx.cpu_group)
        cmd, n_tok, n_seq, width, n_logits, max_q, n_decodes, has_state, n_before, n_after, n_lora, n_loads = \
            header.tolist()
        if cmd == STOP:
            return None
        sizes = [n_tok, n_tok, n_tok, n_seq * width, n_seq, n_seq + 1, n_logits, n_seq * has_state, 2 * n_before,
                 2 * n_after, n_lora, n_loads]
        payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
        dist.broadcast(payload, 0, group=self.ctx.group)
        ids, pos, slots, bt, seq_lens, cu, logits, state, before, after, lora_slots, loads = payload.split(sizes)
        meta = AttentionMetadata(slots, bt.view(n_seq, width).int(), seq_lens.int(), cu.int(), max_q, logits,
                                 n_decodes, state[:n_seq] if has_state else None,
                                 state[n_seq:] if has_state == 2 else None)
        lora = (lora_slots if n_lora else None, json.loads(bytes(loads.tolist())) if n_loads else [])
        return ids, pos, meta, before.view(-1, 2), after.view(-1, 2), lora

    # -- stop ----------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self.rank == 0 and self.ctx is not None and self.ready and not self._failed.is_set():
            def stop() -> None:
                try:
                    dist.broadcast(torch.tensor([STOP] + [0] * (_HEADER - 1), dtype=torch.int64), 0,
                                   group=self.ctx.cpu_group)
                except Exception as e:
                    log.warning("could not tell the tensor-parallel ranks to stop: %s", e)
            t = threading.Thread(target=stop, daemon=True)
            t.start()
            t.join(timeout / 2)
        elif self.rank == 0:  # never got as far as serving steps: nothing to say to them
            for proc in self.children.values():
                if proc.poll() is None:
                    proc.kill()
        # Every rank tears its communicators down at the same time (NCCL's teardown waits for the
        # peers: a rank that waits for its children first and then destroys would hang), bounded.
        if dist.is_initialized():
            def destroy() -> None:
                try:
                    if self.cuda:  # abort NCCL's communicators: a plain destroy waits on the peers
                        from torch.distributed.distributed_c10d import _abort_process_group

                        _abort_process_group()
                except Exception as e:
                    log.debug("abort process group: %s", e)
                try:
                    dist.destroy_process_group()
                except Exception as e:
                    log.debug("destroy_process_group: %s", e)
            t = threading.Thread(target=destroy, daemon=True)
            t.start()
            t.join(timeout)
            if t.is_alive():
                log.warning("tensor-parallel rank %d: process group teardown did not finish in %.0fs", self.rank, timeout)
        deadline = time.monotonic() + timeout
        for rank, proc in self.children.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank %d did not stop; killing it", rank)
                proc.kill()
                proc.wait()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        try:
            atexit.unregister(self.shutdown)
        except Exception:
            pass
