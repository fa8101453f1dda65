"""One server's run of a plan, simulated event to event (see `capacity.py` for the model).

The client keeps each partition's concurrency in flight; the engine takes waiting requests
first come first served while the cache has room for their prompt and one more step, every
running request then gains one token per step, and when the cache is full the newest request
is preempted (its tokens are kept and recomputed when it is admitted again), as vLLM does
and close to SGLang's retraction. The simulation jumps from event to event (a request
finishes, the cache fills), so 10^5 samples take well under a second.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from draftgen.planning.workload import ServerCapacity, Workload


@dataclass(slots=True)
class Totals:
    duration_s: float = 0.0
    running_area: float = 0.0  # Σ running × seconds, over all servers
    waiting_area: float = 0.0
    steps: int = 0
    preemptions: int = 0


class _Req:
    __slots__ = ("ctx", "i", "part", "rem", "s0")

    def __init__(self, i: int, part: str, ctx: int, rem: int) -> None:
        self.i = i
        self.part = part
        self.ctx = ctx  # tokens to (re)compute on admission: prompt + anything generated
        self.rem = rem  # output tokens still to generate
        self.s0 = 0  # the step it was (last) admitted at


def simulate(server: ServerCapacity, w: Workload, share: list[int], outputs: list[int],
              caps: Mapping[str, int], finish: dict[int, float], totals: Totals) -> None:
    """One server's run, event to event. Updates `finish` (sample -> time) and `totals`."""
    cap_kv = float(server.kv_tokens)
    frag = (server.block_size - 1) / 2
    max_running = server.max_running or len(share)
    step_cache: dict[int, float] = {}
    speed = server.speed
    prefill_s = 1 / speed.prefill_tok_s if speed.prefill_tok_s else 0.0
    queues: dict[str, deque[int]] = {}
    for i in share:
        queues.setdefault(w.partitions[i], deque()).append(i)
    in_flight = dict.fromkeys(queues, 0)
    waiting: deque[_Req] = deque()
    # Insertion order is admission order: popitem() preempts the newest, as vLLM does.
    running: dict[int, _Req] = {}
    heap: list[tuple[int, int]] = []  # (finish step, admission serial); stale after preemption
    serial = 0
    s = 0
    t = 0.0
    base = 0.0  # Σ (ctx + frag - s0) over running: cache use at step s is base + batch·s
    run_area = wait_area = 0.0
    while True:
        for part, q in queues.items():
            while q and in_flight[part] < caps[part]:
                i = q.popleft()
                in_flight[part] += 1
                waiting.append(_Req(i, part, w.prompt_tokens[i], outputs[i]))
        batch = len(running)
        used = base + batch * s
        prefill = 0
        while waiting and batch < max_running:
            r = waiting[0]
            need = r.ctx + frag
            # Room for its prompt and one more step of everyone; alone it always fits.
            if batch and used + need + batch + 1 > cap_kv:
                break
            waiting.popleft()
            serial += 1
            r.s0 = s
            running[serial] = r
            heapq.heappush(heap, (s + r.rem, serial))
            base += need - s
            used += need
            batch += 1
            prefill += r.ctx
        if prefill and prefill_s:
            dt = prefill * prefill_s
            t += dt
            run_area += batch * dt
            wait_area += len(waiting) * dt
        if not batch:
            break  # nothing queued anywhere: every sample of this server is done
        while heap[0][1] not in running:
            heapq.heappop(heap)
        fin_step = heap[0][0]
        steps_to_full = max(0, math.floor((cap_kv - used) / batch))
        k = min(fin_step - s, steps_to_full)
        if k:
            st = step_cache.get(batch)
            if st is None:
                st = step_cache[batch] = speed.step_s(batch)
            dt = k * st
            t += dt
            s += k
            run_area += batch * dt
            wait_area += len(waiting) * dt
        if s == fin_step:
            while heap and heap[0][0] == s:
                _, sid = heapq.heappop(heap)
                r_done = running.pop(sid, None)
                if r_done is None:
                    continue
                base -= r_done.ctx + frag - r_done.s0
                in_flight[r_done.part] -= 1
                finish[r_done.i] = t
        else:
            _, r = running.popitem()
            base -= r.ctx + frag - r.s0
            done = s - r.s0
            r.ctx += done
            r.rem -= done
            waiting.appendleft(r)
            totals.preemptions += 1
    totals.duration_s = max(totals.duration_s, t)
    totals.running_area += run_area
    totals.waiting_area += wait_area
    totals.steps += s
