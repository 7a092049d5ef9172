"""`sync.transport=distributed`: per bucket, each engine's leader rank broadcasts one flat buffer
over a weight-update group it made once with its engine's TP ranks through
/init_weights_update_group (NCCL on GPU, gloo on CPU), inside a weight-update session per
version. Not colocated on GPU: NCCL refuses two ranks of one group on one device (rltrain/config/).

The trainer's end of each group is built outside torch's group registry
(`runtime.weight_group.UnregisteredGroup`): the world's destroy between steps must not take it
down. A MoE model's expert buckets go only to the EP ranks that own them (the plan's targets).

Only the leader works here: the broadcast's other end is the engine's ranks, never another
trainer rank, whose part is the stream's gathers alone. So a failure of the leader's (any error)
is kept while it keeps joining those gathers, and raised after, where every rank agrees on it.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from rltrain.engine.client import EngineError
from rltrain.runtime.net import free_port
from rltrain.runtime.weight_group import UnregisteredGroup, close_weight_update_group
from rltrain.sync.transport import Named, SessionEnds, SyncContext, WeightStream, end_session, failure_text

log = logging.getLogger("rltrain.sync")


class DistributedTransport:
    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        self.timings: dict[str, float] = {}
        self.ends = SessionEnds()
        self._groups: list[UnregisteredGroup] = []
        self._group_name = f"rltrain_weights_{ctx.engine_name.replace('-', '_')}"

    def send(self, version: str, weights: WeightStream) -> int:
        ctx = self.ctx
        self.timings = dict.fromkeys(("gather",), 0.0)
        self.ends = SessionEnds()
        if not ctx.sender:
            for _ in weights.buckets(self.timings):  # join every gather
                pass
            if weights.failure is not None:
                raise RuntimeError(weights.failure)
            return 0
        sent, failure = 0, None
        try:
            if not self._groups:
                self._groups = [self._open_group(r) for r in range(len(ctx.receivers))]
            for client in ctx.receivers:  # SGLang requires a weight-update session around the updates
                client.begin_weight_update()
        except Exception as e:  # noqa: BLE001 - any: this rank keeps joining the gathers, reports after
            failure = e
        try:
            for i, bucket, named in weights.buckets(self.timings):
                if named is None or failure is not None or weights.failure is not None:
                    continue  # keep joining the gathers; the failure is reported after
                try:
                    for r in bucket.targets:  # routed: only the EP ranks that own these weights
                        self._broadcast(r, named, version if i == ctx.plan.last_buckets[r] else None)
                    sent += bucket.nbytes * len(bucket.targets)
                except Exception as e:  # noqa: BLE001 - any: this rank keeps joining the gathers, reports after
                    failure = e
        finally:
            for r in range(len(ctx.receivers)):  # each session, also after another's end failed
                try:
                    end_session(ctx, r, self.ends)
                except Exception as e:  # noqa: BLE001 - reported after
                    failure = failure or e
        if failure is not None:
            raise RuntimeError(failure_text(failure)) from failure
        if weights.failure is not None:
            raise RuntimeError(weights.failure)
        return sent

    def _name(self, receiver: int) -> str:
        return f"{self._group_name}_ep{receiver}"

    def _open_group(self, receiver: int) -> UnregisteredGroup:
        ctx = self.ctx
        port = free_port()
        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        size = 1 + ctx.tp_size
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(
                ctx.receivers[receiver].init_weights_update_group,
                "127.0.0.1",
                port,
                1,
                size,
                self._name(receiver),
                backend,
            )
            pg = UnregisteredGroup(
                "127.0.0.1", port, 0, size, self._name(receiver), backend, timeout_s=ctx.request_timeout_s
            )
            joined.result()
        return pg

    def _broadcast(self, receiver: int, named: Named, version: str | None) -> None:
        client = self.ctx.receivers[receiver]
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(
                client.update_weights_from_distributed,
                [n for n, _ in named],
                [str(t.dtype).removeprefix("torch.") for _, t in named],
                [list(t.shape) for _, t in named],
                self._name(receiver),
                version,
                version is not None,
                "flattened_bucket",
            )
            # If the engine refuses the request it never joins the broadcast: stop waiting then.
            self._groups[receiver].broadcast(flat, src=0, give_up=lambda: received.done() and received.exception())
            received.result()

    def engine_restarted(self) -> None:
        """The engine's ends of the groups died with it: ours are dropped (the next send opens new ones)."""
        for pg in self._groups:
            try:
                pg.abort()
            except (RuntimeError, OSError) as e:
                log.warning("dropping the weight-update group of a dead engine: %s", e)
        self._groups = []

    def close(self) -> None:
        for r, pg in enumerate(self._groups):
            # Both ends tear down at once: NCCL's communicator teardown waits for its peer.
            with ThreadPoolExecutor(1) as pool:
                left = pool.submit(self.ctx.receivers[r].destroy_weights_update_group, self._name(r))
                close_weight_update_group(pg)
                try:
                    left.result()
                except EngineError as e:
                    log.warning("engine did not leave the weight-update group: %s", e)
        self._groups = []
