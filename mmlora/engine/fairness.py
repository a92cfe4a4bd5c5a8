"""Fair admission across clients: the Virtual Token Counter (Sheng et al., OSDI 2024) and per-client limits.

A client is whoever a request is billed to: its ``client_id`` (OpenAI's ``user``) when given, else its
adapter's name, else the base model. VTC keeps one counter of weighted service per client:

- admitting a request charges its client ``prefill_weight * prompt tokens``;
- every generated token charges ``decode_weight``;
- admission always serves the backlogged client (one with waiting requests) whose counter is smallest;
- a client that becomes backlogged is lifted to the smallest counter among the backlogged clients (or,
  when nobody waits, to the counter of the client that last left the queue), so idle time earns no credit.

The paper's bound (its Theorem 4.4): over any interval in which clients f and g are both backlogged,
``|W_f - W_g| <= 2 * max(prefill_weight * L_in, decode_weight * M)``, where ``W`` is weighted service,
``L_in`` the longest prompt and ``M`` the most tokens the running batch can hold. Charging happens here, in
one place; the scheduler only asks for an order and reports what it admitted and what was generated.

A preempted request goes back to its client's queue without being charged again for its recompute: the
system chose to preempt it, the client did not ask for the work twice.
"""

from __future__ import annotations

import collections
import heapq
import json
from collections.abc import Iterable
from dataclasses import dataclass

BASE_CLIENT = "base"


@dataclass
class ClientStats:
    """What one client has been served and has queued; read by metrics and the app."""

    counter: float = 0.0
    waiting: int = 0
    running: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class VirtualTokenCounter:
    """Counters of weighted service per client, with the lift-on-arrival rule."""

    def __init__(self, prefill_weight: float = 1.0, decode_weight: float = 2.0) -> None:
        if not (prefill_weight > 0 and decode_weight > 0):
            raise ValueError("VTC weights must be positive")
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.clients: dict[str, ClientStats] = collections.defaultdict(ClientStats)
        self._last_left = 0.0

    def on_arrival(self, client: str) -> None:
        """A request of ``client`` joins the waiting queue (a new one, or a preempted one re-queued)."""
        stats = self.clients[client]
        if stats.waiting == 0:
            others = [s.counter for c, s in self.clients.items() if s.waiting > 0 and c != client]
            floor = min(others) if others else self._last_left
            stats.counter = max(stats.counter, floor)
        stats.waiting += 1

    def on_leave_queue(self, client: str) -> None:
        """A waiting request leaves the queue without being admitted (abort, refusal)."""
        stats = self.clients[client]
        stats.waiting -= 1
        if stats.waiting == 0:
            self._last_left = stats.counter

    def on_admit(self, client: str, prompt_tokens: int, charge: bool = True) -> None:
        """A waiting request of ``client`` starts running; ``charge=False`` for a preempted one."""
        stats = self.clients[client]
        if charge:
            stats.counter += self.prefill_weight * prompt_tokens
            stats.prefill_tokens += prompt_tokens
        stats.running += 1
        self.on_leave_queue(client)

    def on_preempt(self, client: str) -> None:
        self.clients[client].running -= 1
        self.on_arrival(client)

    def on_decode(self, client: str, num_tokens: int = 1) -> None:
        stats = self.clients[client]
        stats.counter += self.decode_weight * num_tokens
        stats.decode_tokens += num_tokens

    def on_finish(self, client: str) -> None:
        """A running request finished or was aborted."""
        self.clients[client].running -= 1

    def order(self, clients: Iterable[str]) -> list[str]:
        """``clients`` from the least served to the most (ties: the order given, i.e. arrival)."""
        keyed = [(self.clients[c].counter, i, c) for i, c in enumerate(clients)]
        return [c for _, _, c in heapq.nsmallest(len(keyed), keyed)]


@dataclass(frozen=True)
class ClientLimits:
    """Per-client caps; 0 means no cap. ``per_client`` overrides them by client name."""

    max_running: int = 0
    max_queued: int = 0
    per_client: tuple[tuple[str, int, int], ...] = ()

    def running_cap(self, client: str) -> int:
        return next((r for c, r, _ in self.per_client if c == client), self.max_running)

    def queued_cap(self, client: str) -> int:
        return next((q for c, _, q in self.per_client if c == client), self.max_queued)


def load_client_limits(path: str | None, max_running: int, max_queued: int) -> ClientLimits:
    """Limits from flags, overridden per client by a JSON file ``{"client": {"max_running": n, ...}}``."""
    if not path:
        return ClientLimits(max_running, max_queued)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"client_limits_file: cannot read {path!r}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"client_limits_file: {path!r} must hold a JSON object keyed by client name")
    per_client = []
    for client, caps in data.items():
        if not isinstance(caps, dict) or set(caps) - {"max_running", "max_queued"}:
            raise ValueError(
                f"client_limits_file: entry {client!r} must be an object with max_running and/or max_queued"
            )
        vals = [caps.get("max_running", max_running), caps.get("max_queued", max_queued)]
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in vals):
            raise ValueError(f"client_limits_file: entry {client!r}: limits must be integers >= 0")
        per_client.append((str(client), vals[0], vals[1]))
    return ClientLimits(max_running, max_queued, tuple(per_client))
