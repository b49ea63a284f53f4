"""A step's loads of history KV through the connector: started after the schedule, joined after
the forward, before any block can be freed (aborts are applied at the start of a step).

    start(plan.loads)   layer-wise connectors: queued, copied during the forward, which waits
                        per layer (`layer_ready`); others: every layer written right here
    finish()            joins them; {request_id: error} of the loads that failed
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from chatstore.engine.kv_connector import KVConnector
from chatstore.engine.scheduler import KVLoad
from chatstore.engine.sequence import RequestState

log = logging.getLogger(__name__)


class StepLoads:
    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector
        self.loading: list[RequestState] = []  # requests whose load runs during the forward

    def start(self, loads: list[KVLoad]) -> list[tuple[RequestState, Exception]]:
        """Start every load; those that failed at once (their request ends with the error)."""
        connector, failed = self.connector, []
        for load in loads:
            args = (load.seq.request, load.start, load.num_tokens, load.seq.block_table)
            try:
                if connector.layerwise:
                    connector.start_load(*args)
                    self.loading.append(load.seq.group)
                else:
                    connector.load(*args)
            except Exception as exc:
                failed.append((load.seq.group, exc))
        return failed

    @property
    def layer_ready(self) -> Callable[[int], None] | None:
        """What the forward calls before layer i's attention; None when nothing loads."""
        return self.connector.wait_for_layer if self.loading else None

    def finish(self) -> dict[str, Exception]:
        """Join the loads started; {request_id: error} of those that failed."""
        if not self.loading:
            return {}
        try:
            return self.connector.finish_loads()
        except Exception as exc:
            log.exception("connector.finish_loads failed")
            # Unknown state for the requests loading this step; nobody else's blocks are touched.
            return {g.request_id: exc for g in self.loading}
